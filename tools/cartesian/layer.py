"""An O(3)-equivariant tensor product of irreducible Cartesian features, in torch.

Features are concatenations of blocks ``mul × (3,)*l``: each copy is a rank-l traceless
symmetric tensor stored with all ``3**l`` components (flattened, C order), as cartnn does. Irreps
carry e3nn's parity label: ``"1o"`` is a polar vector, ``"1e"`` an axial one; a block is a pseudo
tensor (picks up ``det R``) when its parity differs from ``(-1)**l``.

For every path ``(l1 p1) ⊗ (l2 p2) → (lo po)`` allowed by the triangle rule and ``po = p1·p2``:

    out_o[w, k] += α_o Σ_{u,v,i,j} W_path[u, v, w] · x1[u, i] · x2[v, j] · sqrt(2lo+1) Z^{l1 l2 lo}[i, j, k]

with ``Z`` the Cartesian-3j of :mod:`coupling` and ``α_o = 1/sqrt(Σ_paths→o mul1·mul2)``. The
parity rule is exactly what makes ε-symbols (odd l1+l2+lo) couple the right pseudo/polar blocks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

from closedloop.tools.cartesian.basis import _standard_basis
from closedloop.tools.cartesian.coupling import MAX_L, MAX_TOTAL, _cartesian_3j

__all__ = ["CartesianIrrep", "CartesianIrreps", "CartesianTensorProduct", "to_cartesian", "from_cartesian",
           "rotate_features"]


@dataclass(frozen=True)
class CartesianIrrep:
    """Weight ``l`` and parity ``p`` (+1 even, -1 odd), as in e3nn's ``"2e"``."""

    l: int
    p: int

    def __post_init__(self) -> None:
        if not 0 <= self.l <= MAX_L:
            raise ValueError(f"l must be in [0, {MAX_L}], got {self.l}")
        if self.p not in (1, -1):
            raise ValueError(f"parity must be +1 or -1, got {self.p}")

    @property
    def pseudo(self) -> bool:
        """True when the block transforms with an extra ``det R`` (parity ≠ (-1)**l)."""
        return self.p != (-1) ** self.l

    def __str__(self) -> str:
        return f"{self.l}{'e' if self.p == 1 else 'o'}"


IrrepsSpec = Union[str, "CartesianIrreps", Sequence[tuple[int, tuple[int, int]]]]
_ITEM = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(\d+)\s*([eo])\s*$")


@dataclass(frozen=True)
class CartesianIrreps:
    """A list of ``(mul, irrep)`` blocks; ``dim`` counts Cartesian components (mul·3**l each)."""

    items: tuple[tuple[int, CartesianIrrep], ...]

    @classmethod
    def parse(cls, spec: IrrepsSpec) -> "CartesianIrreps":
        if isinstance(spec, CartesianIrreps):
            return spec
        items = []
        if isinstance(spec, str):
            for chunk in spec.split("+"):
                m = _ITEM.match(chunk)
                if m is None:
                    raise ValueError(f"cannot parse irreps item {chunk.strip()!r} in {spec!r}; "
                                     f"write e.g. '8x0e + 4x1o'")
                items.append((int(m.group(1) or 1), CartesianIrrep(int(m.group(2)), 1 if m.group(3) == "e" else -1)))
        else:
            for mul, (l, p) in spec:
                items.append((int(mul), CartesianIrrep(int(l), int(p))))
        for mul, _ in items:
            if mul < 1:
                raise ValueError(f"multiplicities must be >= 1, got {mul}")
        return cls(tuple(items))

    @property
    def dim(self) -> int:
        return sum(mul * 3**ir.l for mul, ir in self.items)

    @property
    def standard_dim(self) -> int:
        return sum(mul * (2 * ir.l + 1) for mul, ir in self.items)

    def slices(self) -> list[slice]:
        out, start = [], 0
        for mul, ir in self.items:
            out.append(slice(start, start + mul * 3**ir.l))
            start += mul * 3**ir.l
        return out

    def __str__(self) -> str:
        return " + ".join(f"{mul}x{ir}" for mul, ir in self.items)


def _basis(l: int, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(np.array(_standard_basis(l)), dtype=like.dtype, device=like.device)


def to_cartesian(irreps: IrrepsSpec, x: torch.Tensor) -> torch.Tensor:
    """Standard-basis (e3nn-layout) features ``(..., Σ mul(2l+1))`` → Cartesian ``(..., Σ mul·3**l)``."""
    irreps = CartesianIrreps.parse(irreps)
    if x.shape[-1] != irreps.standard_dim:
        raise ValueError(f"expected last dim {irreps.standard_dim} for {irreps}, got {x.shape[-1]}")
    out, start = [], 0
    for mul, ir in irreps.items:
        d = 2 * ir.l + 1
        block = x[..., start:start + mul * d].reshape(*x.shape[:-1], mul, d)
        out.append((block @ _basis(ir.l, x).T).reshape(*x.shape[:-1], mul * 3**ir.l))
        start += mul * d
    return torch.cat(out, dim=-1)


def from_cartesian(irreps: IrrepsSpec, x: torch.Tensor) -> torch.Tensor:
    """Cartesian features → standard-basis coefficients (drops any non-irreducible component)."""
    irreps = CartesianIrreps.parse(irreps)
    if x.shape[-1] != irreps.dim:
        raise ValueError(f"expected last dim {irreps.dim} for {irreps}, got {x.shape[-1]}")
    out = []
    for (mul, ir), s in zip(irreps.items, irreps.slices()):
        block = x[..., s].reshape(*x.shape[:-1], mul, 3**ir.l)
        out.append((block @ _basis(ir.l, x)).reshape(*x.shape[:-1], mul * (2 * ir.l + 1)))
    return torch.cat(out, dim=-1)


def rotate_features(irreps: IrrepsSpec, x: torch.Tensor, rotation: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Act with ``R ∈ O(3)`` on Cartesian features: ``R^{⊗l}`` per copy, times ``det R`` for pseudo blocks."""
    irreps = CartesianIrreps.parse(irreps)
    r = torch.as_tensor(rotation, dtype=x.dtype, device=x.device)
    det = torch.linalg.det(r)
    out = []
    for (mul, ir), s in zip(irreps.items, irreps.slices()):
        block = x[..., s].reshape(*x.shape[:-1], mul, *([3] * ir.l))
        nd = block.dim()
        for axis in range(nd - ir.l, nd):
            block = torch.movedim(torch.tensordot(block, r, dims=([axis], [1])), -1, axis)
        if ir.pseudo:
            block = block * det
        out.append(block.reshape(*x.shape[:-1], mul * 3**ir.l))
    return torch.cat(out, dim=-1)


@dataclass(frozen=True)
class _Path:
    i1: int
    i2: int
    io: int
    key: str  # buffer name of the scaled Cartesian-3j
    weight_shape: tuple[int, int, int]


class CartesianTensorProduct(torch.nn.Module):
    """Fully connected tensor product of two irreducible Cartesian features with learnable path weights.

    ``forward(x1, x2)`` takes ``(..., irreps_in1.dim)`` and ``(..., irreps_in2.dim)`` and returns
    ``(..., irreps_out.dim)``. Output blocks no path can reach stay zero (listed in
    ``unreachable_outputs``). Equivariant under O(3) when inputs lie in the traceless symmetric
    subspaces (use :func:`to_cartesian`); other components are projected away by ``Z``.
    """

    def __init__(self, irreps_in1: IrrepsSpec, irreps_in2: IrrepsSpec, irreps_out: IrrepsSpec, *,
                 dtype: torch.dtype | None = None, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.irreps_in1 = CartesianIrreps.parse(irreps_in1)
        self.irreps_in2 = CartesianIrreps.parse(irreps_in2)
        self.irreps_out = CartesianIrreps.parse(irreps_out)
        dtype = dtype or torch.get_default_dtype()
        paths: list[_Path] = []
        # Same path order and weight layout as e3nn's FullyConnectedTensorProduct, so weights transfer.
        for i1, (m1, ir1) in enumerate(self.irreps_in1.items):
            for i2, (m2, ir2) in enumerate(self.irreps_in2.items):
                for io, (mo, iro) in enumerate(self.irreps_out.items):
                    if (abs(ir1.l - ir2.l) <= iro.l <= ir1.l + ir2.l and iro.p == ir1.p * ir2.p
                            and ir1.l + ir2.l + iro.l <= MAX_TOTAL):
                        key = f"z_{ir1.l}_{ir2.l}_{iro.l}"
                        if not hasattr(self, key):
                            z = np.array(_cartesian_3j(ir1.l, ir2.l, iro.l)) * math.sqrt(2 * iro.l + 1)
                            self.register_buffer(key, torch.as_tensor(z, dtype=dtype), persistent=False)
                        paths.append(_Path(i1, i2, io, key, (m1, m2, mo)))
        self.paths = paths
        fan_in = [0] * len(self.irreps_out.items)
        for p in paths:
            fan_in[p.io] += p.weight_shape[0] * p.weight_shape[1]
        self.alpha = [1.0 / math.sqrt(f) if f else 0.0 for f in fan_in]
        self.unreachable_outputs = [str(self.irreps_out.items[i][1]) for i, f in enumerate(fan_in) if f == 0]
        self.weight_numel = sum(math.prod(p.weight_shape) for p in paths)
        self.weight = torch.nn.Parameter(torch.randn(self.weight_numel, dtype=dtype, generator=generator))

    def _path_weights(self) -> list[torch.Tensor]:
        out, start = [], 0
        for p in self.paths:
            n = math.prod(p.weight_shape)
            out.append(self.weight[start:start + n].view(p.weight_shape))
            start += n
        return out

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        if x1.shape[-1] != self.irreps_in1.dim or x2.shape[-1] != self.irreps_in2.dim:
            raise ValueError(f"expected last dims {self.irreps_in1.dim} ({self.irreps_in1}) and "
                             f"{self.irreps_in2.dim} ({self.irreps_in2}), got {x1.shape[-1]} and {x2.shape[-1]}")
        batch = torch.broadcast_shapes(x1.shape[:-1], x2.shape[:-1])
        x1 = x1.expand(*batch, x1.shape[-1])
        x2 = x2.expand(*batch, x2.shape[-1])
        s1, s2 = self.irreps_in1.slices(), self.irreps_in2.slices()
        blocks: list[torch.Tensor | None] = [None] * len(self.irreps_out.items)
        for p, w in zip(self.paths, self._path_weights()):
            (m1, ir1), (m2, ir2) = self.irreps_in1.items[p.i1], self.irreps_in2.items[p.i2]
            a = x1[..., s1[p.i1]].reshape(*batch, m1, 3**ir1.l)
            b = x2[..., s2[p.i2]].reshape(*batch, m2, 3**ir2.l)
            y = torch.einsum("...ui,...vj,ijk,uvw->...wk", a, b, getattr(self, p.key), w) * self.alpha[p.io]
            prev = blocks[p.io]
            blocks[p.io] = y if prev is None else prev + y
        out = []
        for io, (mo, iro) in enumerate(self.irreps_out.items):
            block = blocks[io]
            if block is None:
                block = x1.new_zeros(*batch, mo, 3**iro.l)
            out.append(block.reshape(*batch, mo * 3**iro.l))
        return torch.cat(out, dim=-1)

    def extra_repr(self) -> str:
        return f"{self.irreps_in1} x {self.irreps_in2} -> {self.irreps_out}, {len(self.paths)} paths, {self.weight_numel} weights"
