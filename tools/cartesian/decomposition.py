"""Irreducible decomposition of rank-n Cartesian tensors by coupling paths (an ICTD in the paper's words).

A path ``(j_1=1, j_2, ..., j_n)`` records the weight after coupling each new vector index: rank n
carries one irreducible copy of weight ``j_n`` per path. Its change of basis ``C`` (``3**n ×
(2j_n+1)``) is built by the recursion (newest Cartesian index first, as in cartnn)

    C_path[a, rest, M] = Σ_μ G_{1, j_{n-1}, j_n}[a, μ, M] · C_{path[:-1]}[rest, μ],
    G_{1,j,l} = sqrt(2l+1) · standard_3j(1, j, l),

so every ``C`` is an isometry (``CᵀC = 1``) that intertwines ``D_l`` with ``R^{⊗n}``
(``R^{⊗n} C = C D_l(R)``), copies are mutually orthogonal and ``Σ_path C Cᵀ = 1``. Grouping paths
by their final weight reproduces the Casimir projectors of :mod:`basis`, a cross-check that uses
two independent constructions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from closedloop.tools.cartesian.basis import MAX_RANK, _check_rank, _standard_basis, _weight_projectors, rank_of_size
from closedloop.tools.cartesian.coupling import _standard_3j

__all__ = ["IrreducibleCopy", "coupling_paths", "change_of_basis", "multiplicities", "decompose", "Decomposition"]


@dataclass(frozen=True)
class IrreducibleCopy:
    """One weight-l copy inside rank-n tensors: its path and orthonormal change of basis."""

    path: tuple[int, ...]
    matrix: np.ndarray  # 3**n × (2l+1), columns orthonormal; standard-basis coefficients → Cartesian

    @property
    def l(self) -> int:
        return self.path[-1] if self.path else 0

    @property
    def rank(self) -> int:
        return len(self.path)


def coupling_paths(n: int) -> list[tuple[int, ...]]:
    """All coupling paths of rank n, in lexicographic order; ``[()]`` for rank 0."""
    _check_rank(n)
    paths: list[tuple[int, ...]] = [()]
    for _ in range(n):
        nxt = []
        for p in paths:
            j = p[-1] if p else 0
            for k in range(abs(j - 1), j + 2):
                nxt.append(p + (k,))
        paths = nxt
    return sorted(paths)


@lru_cache(maxsize=None)
def _path_matrix(path: tuple[int, ...]) -> np.ndarray:
    if not path:
        out = np.ones((1, 1))
    elif len(path) == 1:
        out = _standard_basis(1)
    else:
        j, l = path[-2], path[-1]
        g = math.sqrt(2 * l + 1) * _standard_3j(1, j, l)  # (3, 2j+1, 2l+1)
        prev = _path_matrix(path[:-1])  # (3**(n-1), 2j+1)
        out = np.einsum("amM,rm->arM", g, prev).reshape(3 * prev.shape[0], 2 * l + 1)
    out.setflags(write=False)
    return out


def change_of_basis(n: int, l: int | None = None) -> list[IrreducibleCopy]:
    """Every irreducible copy of rank-n tensors (only weight ``l`` if given), as fresh float64 arrays."""
    _check_rank(n)
    copies = []
    for p in coupling_paths(n):
        if l is None or (p[-1] if p else 0) == l:
            copies.append(IrreducibleCopy(p, _path_matrix(p).copy()))
    return copies


def multiplicities(n: int) -> dict[int, int]:
    """``{l: number of weight-l copies in rank n}``; Σ mult·(2l+1) = 3**n."""
    counts: dict[int, int] = {}
    for p in coupling_paths(n):
        l = p[-1] if p else 0
        counts[l] = counts.get(l, 0) + 1
    return dict(sorted(counts.items()))


@dataclass
class Decomposition:
    """A rank-n tensor split by weight: ``parts[l]`` are rank-n tensors that sum to the input."""

    rank: int
    parts: dict[int, np.ndarray]  # l -> (3,)*n tensor in the weight-l subspace
    coefficients: dict[tuple[int, ...], np.ndarray]  # path -> standard-basis coefficients (2l+1,)

    def norms(self) -> dict[int, float]:
        return {l: float(np.linalg.norm(p)) for l, p in self.parts.items()}


def decompose(tensor: np.ndarray) -> Decomposition:
    """Split a ``(3,)*n`` (or flat ``3**n``) tensor into weight parts and per-path coefficients.

    Parts use the Casimir projectors; coefficients use the path isometries. Both are returned
    because the parts are basis-free (what a caller usually wants) while the coefficients feed
    spherical/e3nn-style code.
    """
    t = np.asarray(tensor, dtype=float)
    n = rank_of_size(t.size)
    if n is None or (t.ndim > 1 and t.shape != (3,) * n):
        raise ValueError(f"a rank-n Cartesian tensor has shape (3,)*n or 3**n entries; got shape {t.shape}")
    if n > MAX_RANK:
        raise ValueError(f"rank {n} exceeds the supported maximum {MAX_RANK} (3**{MAX_RANK} components)")
    if not np.all(np.isfinite(t)):
        raise ValueError("tensor contains NaN or infinite values")
    flat = t.reshape(-1)
    parts = {l: (p @ flat).reshape((3,) * n) for l, p in _weight_projectors(n).items()}
    coefficients = {p: _path_matrix(p).T @ flat for p in coupling_paths(n)}
    return Decomposition(n, parts, coefficients)
