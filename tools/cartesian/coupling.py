"""Cartesian-3j symbols: the invariant coupling l_a ⊗ l_b → l_c between traceless symmetric tensors.

Construction (classical, not cartnn's path product): pair the l_a + l_b + l_c Cartesian indices
with Kronecker deltas, ``k_ab = (l_a+l_b-l_c)/2`` between slots a and b and likewise for the other
two pairs; when the sum is odd, first tie one index of every slot to a Levi-Civita ε and pair the
rest. Then project every slot onto its traceless symmetric part:

    Z = (P_{l_a} ⊗ P_{l_b} ⊗ P_{l_c}) T_raw,      Z ← Z / ‖Z‖_F.

The raw tensor is not inside the irreducible subspaces (the paper's caveat, shown in the tests);
after projection it is the unique (up to scale) invariant, so it equals the Wigner-3j after the
change of basis. Parity: δ-only symbols (even sum) are O(3)-invariant; those with ε pick up
``det R``. The projection is done in the standard basis, ``W = Σ T_raw U_a U_b U_c`` by one
einsum over the pairing, which never builds the raw tensor.
"""

from __future__ import annotations

import string
from functools import lru_cache

import numpy as np

from closedloop.tools.cartesian.basis import _standard_basis, levi_civita

__all__ = ["MAX_L", "MAX_TOTAL", "check_triangle", "raw_coupling", "cartesian_3j", "standard_3j"]

MAX_L = 6
# Z has 3**(l_a+l_b+l_c) entries: 3**12 = 531441 (4 MiB) is the most we build densely.
MAX_TOTAL = 12


def check_triangle(l_a: int, l_b: int, l_c: int) -> None:
    """Raise ValueError unless each l is in [0, MAX_L], |l_a-l_b| ≤ l_c ≤ l_a+l_b and the total ≤ MAX_TOTAL."""
    for name, l in (("l_a", l_a), ("l_b", l_b), ("l_c", l_c)):
        if not isinstance(l, (int, np.integer)) or isinstance(l, bool) or not 0 <= l <= MAX_L:
            raise ValueError(f"{name} must be an integer in [0, {MAX_L}], got {l!r}")
    if not abs(l_a - l_b) <= l_c <= l_a + l_b:
        raise ValueError(f"(l_a, l_b, l_c) = ({l_a}, {l_b}, {l_c}) violates the triangle rule "
                         f"|l_a - l_b| <= l_c <= l_a + l_b; no invariant coupling exists")
    if l_a + l_b + l_c > MAX_TOTAL:
        raise ValueError(f"l_a + l_b + l_c = {l_a + l_b + l_c} exceeds {MAX_TOTAL}: the Cartesian tensor would "
                         f"have 3**{l_a + l_b + l_c} entries")


def _pairing(l_a: int, l_b: int, l_c: int) -> tuple[list[str], list[str], list[str], str | None]:
    """Index letters per slot; a letter shared by two slots is a δ, the first letters may meet an ε."""
    letters = iter(string.ascii_lowercase)
    a: list[str] = []
    b: list[str] = []
    c: list[str] = []
    eps = None
    if (l_a + l_b + l_c) % 2:
        i, j, k = next(letters), next(letters), next(letters)
        a.append(i)
        b.append(j)
        c.append(k)
        eps = i + j + k
        l_a, l_b, l_c = l_a - 1, l_b - 1, l_c - 1
    k_ab, k_ac, k_bc = (l_a + l_b - l_c) // 2, (l_a + l_c - l_b) // 2, (l_b + l_c - l_a) // 2
    for _ in range(k_ab):
        x = next(letters)
        a.append(x)
        b.append(x)
    for _ in range(k_ac):
        x = next(letters)
        a.append(x)
        c.append(x)
    for _ in range(k_bc):
        x = next(letters)
        b.append(x)
        c.append(x)
    return a, b, c, eps


def raw_coupling(l_a: int, l_b: int, l_c: int) -> np.ndarray:
    """The unprojected δ/ε pairing, shape ``(3**l_a, 3**l_b, 3**l_c)``; invariant but reducible per slot."""
    check_triangle(l_a, l_b, l_c)
    a, b, c, eps = _pairing(l_a, l_b, l_c)
    operands: list[np.ndarray] = []
    terms: list[str] = []
    if eps is not None:
        operands.append(levi_civita())
        terms.append(eps)
    shared = [x for x in a if x in b or x in c] + [x for x in b if x in c]
    for x in shared:
        x2 = x.upper()  # the partner slot gets the capital letter, tied by δ
        operands.append(np.eye(3))
        terms.append(x + x2)
    renamed_b = [x.upper() if x in a else x for x in b]
    renamed_c = [x.upper() if (x in a or x in b) else x for x in c]
    out = "".join(a) + "".join(renamed_b) + "".join(renamed_c)
    if not operands:  # (0, 0, 0)
        return np.ones((1, 1, 1))
    t = np.einsum(",".join(terms) + "->" + out, *operands)
    return t.reshape(3**l_a, 3**l_b, 3**l_c)


@lru_cache(maxsize=None)
def _standard_3j(l_a: int, l_b: int, l_c: int) -> np.ndarray:
    a, b, c, eps = _pairing(l_a, l_b, l_c)
    greek = iter("ABC")
    terms, operands = [], []
    for slot, l in ((a, l_a), (b, l_b), (c, l_c)):
        m = next(greek)
        terms.append("".join(slot) + m)
        operands.append(_standard_basis(l).reshape((3,) * l + (2 * l + 1,)))
    if eps is not None:
        terms.append(eps)
        operands.append(levi_civita())
    w = np.einsum(",".join(terms) + "->ABC", *operands)
    norm = np.linalg.norm(w)
    if norm < 1e-8:  # would mean the pairing dies under projection; checked for all triples in tests
        raise RuntimeError(f"coupling ({l_a}, {l_b}, {l_c}) vanishes after projection")
    w = w / norm
    w.setflags(write=False)
    return w


def standard_3j(l_a: int, l_b: int, l_c: int) -> np.ndarray:
    """The 3j symbol in the standard (real SH, y-polar) basis, ``(2l_a+1, 2l_b+1, 2l_c+1)``, norm 1."""
    check_triangle(l_a, l_b, l_c)
    return _standard_3j(l_a, l_b, l_c).copy()


@lru_cache(maxsize=None)
def _cartesian_3j(l_a: int, l_b: int, l_c: int) -> np.ndarray:
    w = _standard_3j(l_a, l_b, l_c)
    u_a, u_b, u_c = _standard_basis(l_a), _standard_basis(l_b), _standard_basis(l_c)
    z = np.einsum("iA,ABC->iBC", u_a, w)
    z = np.einsum("jB,iBC->ijC", u_b, z)
    z = np.einsum("kC,ijC->ijk", u_c, z)
    z.setflags(write=False)
    return z


def cartesian_3j(l_a: int, l_b: int, l_c: int) -> np.ndarray:
    """The Cartesian-3j tensor ``Z`` of shape ``(3**l_a, 3**l_b, 3**l_c)``, Frobenius norm 1.

    Each slot lies in the traceless symmetric subspace; ``(R^{⊗l_a}⊗R^{⊗l_b}⊗R^{⊗l_c}) Z =
    det(R)^{(l_a+l_b+l_c) mod 2} Z`` for every R in O(3). Copy of a cached float64 array.
    """
    check_triangle(l_a, l_b, l_c)
    return _cartesian_3j(l_a, l_b, l_c).copy()
