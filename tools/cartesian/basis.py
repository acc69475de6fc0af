"""so(3) action on rank-n Cartesian tensors: generators, Casimir projectors, standard irrep bases.

Everything is float64 numpy and built from the Levi-Civita symbol alone (no e3nn at run time), so
the irreducible decomposition is exact up to float64 rounding and can be checked against e3nn in
tests instead of being derived from it.

Conventions (shared by the whole ``closedloop.tools.cartesian`` package):

- A rank-n tensor ``T`` has shape ``(3,)*n`` or is flattened C-order to ``(3**n,)``; a rotation
  ``R`` acts as ``R^{⊗n}``: ``T'_{i1..in} = R_{i1 j1}...R_{in jn} T_{j1..jn}``.
- ``J_k`` with ``(J_k)_{ij} = -ε_{kij}`` generates rotations about axis ``k`` (``exp(θ J_z)`` turns
  x towards y). On rank n the generator is the Kronecker sum ``Σ_s 1⊗..⊗J_k⊗..⊗1`` and the
  Casimir ``L² = -Σ_k (Σ_s J_k^{(s)})²`` has eigenvalues ``l(l+1)``, ``l = 0..n``.
- The *standard basis* of weight l is an orthonormal basis ``U_l`` (``3**l × (2l+1)``) of the
  rank-l traceless symmetric tensors, ordered m = -l..l as real spherical harmonics with **y as the
  polar axis** (e3nn's choice, so l=1 is (x, y, z)). It is built from the highest weight
  ``(e_z + i e_x)^{⊗l}`` with Condon-Shortley lowering, so its phases are fixed, not random.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

__all__ = [
    "MAX_RANK", "levi_civita", "generators", "casimir", "weight_projectors", "standard_basis",
    "wigner_d", "rotate_tensor", "random_rotation", "rank_of_size",
]

# 3**6 = 729: projectors are 729×729 dense float64 matrices; beyond that the dense approach
# (and any use a model could make of the output) stops being sensible.
MAX_RANK = 6


def levi_civita() -> np.ndarray:
    """The 3×3×3 Levi-Civita symbol ε (float64, a fresh copy)."""
    eps = np.zeros((3, 3, 3))
    for i, j, k in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        eps[i, j, k] = 1.0
        eps[i, k, j] = -1.0
    return eps


def _check_rank(n: int, *, lo: int = 0, hi: int = MAX_RANK, what: str = "rank") -> None:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not lo <= n <= hi:
        raise ValueError(f"{what} must be an integer in [{lo}, {hi}], got {n!r}")


def rank_of_size(size: int) -> int | None:
    """n with 3**n == size, or None when size is not a power of three."""
    n, s = 0, 1
    while s < size:
        s *= 3
        n += 1
    return n if s == size else None


@lru_cache(maxsize=None)
def _generators(n: int) -> np.ndarray:
    single = -levi_civita()  # single[k] = J_k
    out = np.zeros((3, 3**n, 3**n))
    for k in range(3):
        for s in range(n):
            out[k] += np.kron(np.kron(np.eye(3**s), single[k]), np.eye(3 ** (n - s - 1)))
    out.setflags(write=False)
    return out


def generators(n: int) -> np.ndarray:
    """The three so(3) generators on rank-n tensors, shape ``(3, 3**n, 3**n)`` (antisymmetric)."""
    _check_rank(n)
    return _generators(n).copy()


@lru_cache(maxsize=None)
def _casimir(n: int) -> np.ndarray:
    gens = _generators(n)
    out = -np.einsum("kij,kjl->il", gens, gens)
    out.setflags(write=False)
    return out


def casimir(n: int) -> np.ndarray:
    """``L²`` on rank-n tensors (symmetric, integer entries, eigenvalues l(l+1))."""
    _check_rank(n)
    return _casimir(n).copy()


@lru_cache(maxsize=None)
def _weight_projectors(n: int) -> dict[int, np.ndarray]:
    if n == 0:
        one = np.ones((1, 1))
        one.setflags(write=False)
        return {0: one}
    values, vectors = np.linalg.eigh(_casimir(n))
    ls = np.rint((-1.0 + np.sqrt(1.0 + 4.0 * np.clip(values, 0.0, None))) / 2.0).astype(int)
    drift = np.max(np.abs(ls * (ls + 1) - values))
    if drift > 1e-8:  # cannot happen for a correct Casimir; a guard against silent regressions
        raise RuntimeError(f"Casimir eigenvalues of rank {n} are not of the form l(l+1) (off by {drift:.2e})")
    projectors: dict[int, np.ndarray] = {}
    for l in sorted(set(ls.tolist())):
        v = vectors[:, ls == l]
        p = v @ v.T
        p = (p + p.T) / 2.0
        p.setflags(write=False)
        projectors[l] = p
    return projectors


def weight_projectors(n: int) -> dict[int, np.ndarray]:
    """Orthogonal projectors ``{l: P_l}`` (``3**n × 3**n``) onto the weight-l part of rank-n tensors.

    ``P_l`` projects onto the span of all irreducible copies of weight l (the eigenspace of ``L²``
    for ``l(l+1)``); it does not depend on how copies inside that span are chosen. ``Σ_l P_l = 1``.
    """
    _check_rank(n)
    return {l: p.copy() for l, p in _weight_projectors(n).items()}


@lru_cache(maxsize=None)
def _standard_basis(l: int) -> np.ndarray:
    if l == 0:
        out = np.ones((1, 1))
        out.setflags(write=False)
        return out
    gens = _generators(l)
    # Ladder frame with y as the polar axis: x' = z, y' = x, z' = y (right-handed: e_z × e_x = e_y).
    s_x, s_y, s_z = 1j * gens[2], 1j * gens[0], 1j * gens[1]
    lower = s_x - 1j * s_y
    e_plus = np.array([1j, 0.0, 1.0])  # e_z + i e_x
    top = e_plus
    for _ in range(l - 1):
        top = np.kron(top, e_plus)
    top = ((-1) ** l) * top / 2.0 ** (l / 2.0)  # Condon-Shortley phase of |l, l>
    if np.max(np.abs(s_z @ top - l * top)) > 1e-10:
        raise RuntimeError("highest-weight vector is not an eigenvector of S_z'")
    states = {l: top}
    for m in range(l, -l, -1):
        states[m - 1] = lower @ states[m] / math.sqrt((l + m) * (l - m + 1))
    cols = []
    for m in range(-l, l + 1):
        if m < 0:
            cols.append(math.sqrt(2.0) * (-1) ** m * states[-m].imag)
        elif m == 0:
            if np.max(np.abs(states[0].imag)) > 1e-10:
                raise RuntimeError("m = 0 state is not real")
            cols.append(states[0].real)
        else:
            cols.append(math.sqrt(2.0) * (-1) ** m * states[m].real)
    out = np.stack(cols, axis=1)
    out.setflags(write=False)
    return out


def standard_basis(l: int) -> np.ndarray:
    """Orthonormal basis ``U_l`` (``3**l × (2l+1)``) of rank-l traceless symmetric tensors.

    Columns are real spherical harmonics m = -l..l with y polar: the column for m is the tensor
    ``T`` with ``T · x^{⊗l} ∝ Y_lm(x)``. ``U_l U_lᵀ`` is the traceless-symmetric projector
    (= ``weight_projectors(l)[l]``) and ``D_l(R) = U_lᵀ R^{⊗l} U_l`` is the Wigner-D matrix.
    """
    _check_rank(l, what="l")
    return _standard_basis(l).copy()


def rotate_tensor(tensor: np.ndarray, rotation: np.ndarray, *, axes: int | None = None) -> np.ndarray:
    """Apply ``R`` to each of the first ``axes`` (default: all) indices of a ``(3,)*n`` tensor."""
    t = np.asarray(tensor, dtype=float)
    r = np.asarray(rotation, dtype=float)
    if r.shape != (3, 3):
        raise ValueError(f"rotation must be 3×3, got {r.shape}")
    n = t.ndim if axes is None else axes
    if any(d != 3 for d in t.shape[:n]):
        raise ValueError(f"tensor axes must all have length 3, got shape {t.shape}")
    for axis in range(n):
        t = np.moveaxis(np.tensordot(r, t, axes=([1], [axis])), 0, axis)
    return t


def wigner_d(l: int, rotation: np.ndarray) -> np.ndarray:
    """``D_l(R) = U_lᵀ R^{⊗l} U_l``: how standard-basis coefficients of weight l rotate."""
    u = _standard_basis(l)
    if l == 0:
        return np.ones((1, 1))
    cols = rotate_tensor(u.reshape((3,) * l + (2 * l + 1,)), rotation, axes=l).reshape(3**l, 2 * l + 1)
    return u.T @ cols


def random_rotation(rng: np.random.Generator, *, proper: bool = True) -> np.ndarray:
    """A Haar-random rotation (``proper=False``: times -1, an improper element of O(3))."""
    q, r = np.linalg.qr(rng.standard_normal((3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q if proper else -q
