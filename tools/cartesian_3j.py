"""Irreducible Cartesian tensors and Cartesian-3j symbols, as typed tools.

Citation: Xu, Wu, Xie, Hu, "A Cartesian-3j Framework for MLIPs" (ICML 2026; arXiv 2512.16882
v2, v1 "Cartesian-nj: Extending e3nn ..."); reference code xvzemin/cartnn (MIT). This is an
independent numpy/torch implementation, not a port: projectors come from the Casimir operator and
the 3j symbols from δ/ε pairings, and e3nn is used only in tests and the benchmark.

Equations. On rank-n tensors (3ⁿ components) rotations act as ``R^{⊗n}`` and the Casimir is
``L² = -Σ_k (Σ_s J_k^{(s)})²`` with ``(J_k)_{ij} = -ε_{kij}``; its eigenspaces (eigenvalue
``l(l+1)``) give the weight projectors ``P_l``. The Cartesian-3j symbol is

    Z^{l_a l_b l_c} = (P_{l_a} ⊗ P_{l_b} ⊗ P_{l_c}) T_raw / ‖·‖_F,

    T_raw = [ε_{a_1 b_1 c_1}]^{(l_a+l_b+l_c) mod 2} Π δ_{a b}^{k_ab} δ_{a c}^{k_ac} δ_{b c}^{k_bc},

and it equals e3nn's Wigner-3j after the change of basis ``U_l`` on every slot:
``Z = Σ_{αβγ} W3j_{αβγ} U_{l_a}[:, α] ⊗ U_{l_b}[:, β] ⊗ U_{l_c}[:, γ]`` (the tests find sign +1).

Properties (each one tested): ``Σ_l P_l = 1``, ``P_l² = P_l``, ``P_l P_l' = 0``; the per-path
change-of-basis matrices ``C`` satisfy ``CᵀC = 1`` and ``Σ C Cᵀ = 1`` and group into the ``P_l``;
``(R^{⊗l_a}⊗R^{⊗l_b}⊗R^{⊗l_c}) Z = det(R)^{l_a+l_b+l_c} Z`` for R in O(3);
``CartesianTensorProduct`` commutes with O(3).

Shapes: rank-n tensors ``(3,)*n`` or flat ``(3**n,)``; ``standard_basis(l)``: ``(3**l, 2l+1)``;
``cartesian_3j``: ``(3**l_a, 3**l_b, 3**l_c)``; ``standard_3j``: ``(2l_a+1, 2l_b+1, 2l_c+1)``.
Every cached array is float64 and handed out as a copy. The standard basis is real spherical
harmonics with y polar, the same basis e3nn uses.

The paper's caveat holds here too: the raw pairing is not inside the irreducible subspaces
(``raw_coupling``), so compare 3j symbols only after projection.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from closedloop.artifacts import ArrayInput, ArtifactError, array_output, load_array
from closedloop.tool import Tool, tool
from closedloop.tools.cartesian import (MAX_L, MAX_RANK, cartesian_3j, change_of_basis, check_triangle, decompose,
                                        multiplicities, rank_of_size, raw_coupling, standard_3j, standard_basis,
                                        weight_projectors)
from closedloop.tools.cartesian.layer import (CartesianIrrep, CartesianIrreps, CartesianTensorProduct,
                                              from_cartesian, rotate_features, to_cartesian)

__all__ = [
    "TOOLS", "cartesian_3j", "standard_3j", "raw_coupling", "standard_basis", "weight_projectors", "change_of_basis",
    "multiplicities", "decompose", "CartesianIrrep", "CartesianIrreps", "CartesianTensorProduct", "to_cartesian",
    "from_cartesian", "rotate_features", "WeightPart", "DecomposeResult", "ThreeJResult", "ChangeOfBasisResult",
    "CoupleResult",
]


def _load_cartesian(value: ArrayInput, name: str, key: str | None = None) -> tuple[np.ndarray, int]:
    arr = load_array(value, key=key, name=name)
    if arr.dtype.kind not in "biuf":
        raise ArtifactError(f"{name}: expected a real numeric array, got dtype {arr.dtype}")
    arr = arr.astype(float)
    n = rank_of_size(arr.size) if arr.size else None
    if n is None or (arr.ndim > 1 and arr.shape != (3,) * n):
        raise ArtifactError(f"{name}: a rank-n Cartesian tensor has shape (3,)*n or a flat length 3**n "
                            f"(3, 9, 27, ...); got shape {list(arr.shape)}")
    if n == 0:
        raise ArtifactError(f"{name}: a single number is a rank-0 tensor; it is its own l=0 part")
    if n > MAX_RANK:
        raise ArtifactError(f"{name}: rank {n} exceeds the supported maximum {MAX_RANK}")
    return arr.reshape((3,) * n), n


class WeightPart(BaseModel):
    l: int
    multiplicity: int = Field(description="irreducible copies of weight l in this rank")
    norm: float
    fraction: float = Field(description="share of the squared Frobenius norm in weight l")


class DecomposeResult(BaseModel):
    rank: int
    total_norm: float
    weights: list[WeightPart]
    parts_l: list[int] = Field(description="the l of each slice of `parts`, in order")
    parts: Any = Field(description="stacked weight parts, shape (len(parts_l), 3, ..., 3); they sum to the input")
    max_reconstruction_error: float


@tool(timeout_s=120.0)
def cartesian_decompose(tensor: ArrayInput, key: str | None = None) -> DecomposeResult:
    """Split a rank-n Cartesian tensor (3**n components, n = 1..6) into its irreducible weight-l parts.

    Returns the norm of each weight-l part and the parts themselves (inline when small, else a
    .npy artifact). A symmetric traceless rank-n tensor is all weight n; a rank-2 tensor splits into
    trace (l=0), antisymmetric (l=1) and symmetric traceless (l=2) parts.

    Args:
        tensor: path to .npy/.npz/.safetensors, or a nested list, of shape (3,)*n or flat 3**n.
        key: array name inside an .npz/.safetensors file holding several.
    """
    t, n = _load_cartesian(tensor, "tensor", key)
    dec = decompose(t)
    total = float(np.linalg.norm(t))
    mult = multiplicities(n)
    weights = [WeightPart(l=l, multiplicity=mult[l], norm=float(np.linalg.norm(p)),
                          fraction=float(np.linalg.norm(p) ** 2 / total**2) if total > 0 else 0.0)
               for l, p in dec.parts.items()]
    stacked = np.stack([dec.parts[l] for l in sorted(dec.parts)])
    err = float(np.max(np.abs(stacked.sum(axis=0) - t)))
    return DecomposeResult(rank=n, total_norm=total, weights=weights, parts_l=sorted(dec.parts),
                           parts=array_output(stacked, prefix="cartesian-parts"), max_reconstruction_error=err)


class ThreeJResult(BaseModel):
    l_a: int
    l_b: int
    l_c: int
    basis: str
    shape: list[int]
    parity: str = Field(description="'even': invariant under all of O(3); 'odd': built with ε, flips sign under inversion")
    tensor: Any = Field(description="the coupling tensor, Frobenius norm 1 (inline list or .npy artifact)")


@tool
def cartesian_3j_tensor(l_a: Annotated[int, Field(ge=0, le=MAX_L)], l_b: Annotated[int, Field(ge=0, le=MAX_L)],
                        l_c: Annotated[int, Field(ge=0, le=MAX_L)],
                        basis: Literal["cartesian", "spherical"] = "cartesian") -> ThreeJResult:
    """The invariant coupling tensor of weights l_a ⊗ l_b → l_c (a Cartesian-3j symbol).

    "cartesian": shape (3**l_a, 3**l_b, 3**l_c), each slot a traceless symmetric tensor flattened.
    "spherical": shape (2l_a+1, 2l_b+1, 2l_c+1) in e3nn's real spherical harmonic basis, equal
    to e3nn's o3.wigner_3j. Requires |l_a - l_b| <= l_c <= l_a + l_b.

    Args:
        l_a: weight of the first input.
        l_b: weight of the second input.
        l_c: weight of the output.
        basis: "cartesian" or "spherical".
    """
    check_triangle(l_a, l_b, l_c)
    z = cartesian_3j(l_a, l_b, l_c) if basis == "cartesian" else standard_3j(l_a, l_b, l_c)
    return ThreeJResult(l_a=l_a, l_b=l_b, l_c=l_c, basis=basis, shape=list(z.shape),
                        parity="odd" if (l_a + l_b + l_c) % 2 else "even",
                        tensor=array_output(z, prefix=f"cartesian3j-{l_a}{l_b}{l_c}"))


class ChangeOfBasisResult(BaseModel):
    rank: int
    l: int
    multiplicity: int
    paths: list[list[int]] = Field(description="coupling path (weight after each index) of each copy")
    shape: list[int]
    matrices: Any = Field(description="stacked (multiplicity, 3**rank, 2l+1) orthonormal-column matrices")


@tool
def cartesian_change_of_basis(rank: Annotated[int, Field(ge=1, le=MAX_RANK)],
                              l: Annotated[int, Field(ge=0, le=MAX_RANK)]) -> ChangeOfBasisResult:
    """Orthonormal change-of-basis matrices from each weight-l irreducible copy into rank-n tensors.

    Column m of a matrix is the Cartesian tensor of the copy's real spherical harmonic m (e3nn
    order). Summing C Cᵀ over the copies gives the projector onto weight l.

    Args:
        rank: tensor rank n (3**n components).
        l: weight, 0 <= l <= rank; rank 1 has only l = 1.
    """
    mult = multiplicities(rank)
    if l not in mult:
        raise ValueError(f"rank-{rank} tensors have no weight-{l} part; weights present: {sorted(mult)}")
    copies = change_of_basis(rank, l)
    stacked = np.stack([c.matrix for c in copies])
    return ChangeOfBasisResult(rank=rank, l=l, multiplicity=len(copies), paths=[list(c.path) for c in copies],
                               shape=list(stacked.shape), matrices=array_output(stacked, prefix=f"cartesian-cob-{rank}-{l}"))


class CoupleResult(BaseModel):
    l_a: int
    l_b: int
    l_c: int
    irreducible_fraction_a: float = Field(description="share of |a|² in its traceless symmetric part (the rest is ignored)")
    irreducible_fraction_b: float
    norm: float
    result: Any = Field(description="rank-l_c traceless symmetric tensor, shape (3,)*l_c")


@tool
def cartesian_couple(a: ArrayInput, b: ArrayInput, l_c: Annotated[int, Field(ge=0, le=MAX_L)]) -> CoupleResult:
    """Couple two Cartesian tensors of ranks l_a, l_b into weight l_c with the Cartesian-3j symbol.

    out_k = Σ_ij Z[i, j, k] a_i b_j with Z scaled by sqrt(2 l_c + 1); only the traceless symmetric
    parts of a and b take part. E.g. two vectors with l_c = 1 give their cross product / sqrt(2).

    Args:
        a: first tensor, shape (3,)*l_a (path or nested list).
        b: second tensor, shape (3,)*l_b.
        l_c: output weight, |l_a - l_b| <= l_c <= l_a + l_b.
    """
    ta, la = _load_cartesian(a, "a")
    tb, lb = _load_cartesian(b, "b")
    check_triangle(la, lb, l_c)
    z = cartesian_3j(la, lb, l_c) * np.sqrt(2 * l_c + 1)
    out = np.einsum("i,j,ijk->k", ta.reshape(-1), tb.reshape(-1), z).reshape((3,) * l_c)

    def frac(t: np.ndarray, l: int) -> float:
        flat = t.reshape(-1)
        total = float(flat @ flat)
        return float(flat @ weight_projectors(l)[l] @ flat / total) if total > 0 else 0.0

    return CoupleResult(l_a=la, l_b=lb, l_c=l_c, irreducible_fraction_a=frac(ta, la), irreducible_fraction_b=frac(tb, lb),
                        norm=float(np.linalg.norm(out)), result=array_output(out, prefix="cartesian-couple"))


TOOLS: list[Tool] = [cartesian_decompose, cartesian_3j_tensor, cartesian_change_of_basis, cartesian_couple]
