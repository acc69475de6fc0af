"""The correctness verdict on one call, made in the trusted parent from tensors it read itself.

KernelBench's rule (``torch.allclose(out, ref, atol, rtol)`` on every output, same shapes and
dtypes), plus three checks of ours that catch cheap ways to pass it: an output that is the
candidate's input itself (the loop's hint, believed only when the reference does not do the
same), a constant output where the reference varies, and, where an all-zero output would pass
the absolute tolerance, a relative error bound (KernelBench issue #165).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from closedloop.evals.kernelbench.wire import Other, TensorRef, leaves_of


class Verdict(Exception):
    """A final status for the candidate (raised where it is decided)."""

    def __init__(self, status: str, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


def structure(value: Any) -> Any:
    """The nesting of a value, leaves erased (tuples and lists are the same to KernelBench)."""
    if isinstance(value, (list, tuple)):
        return [structure(v) for v in value]
    return "."


def check_layout(out: Any, ref: Any, aliases: list[int | None], ref_aliases: list[int | None], *, where: str) -> None:
    """The checks that need no values (parsed descriptions): structure, shapes, dtypes, aliases."""
    outs, refs = leaves_of(out), leaves_of(ref)
    if len(outs) != len(refs) or structure(out) != structure(ref):
        raise Verdict("shape_mismatch", f"{where}: the candidate returned {len(outs)} output(s) shaped "
                                        f"{structure(out)}, the reference {len(refs)} shaped {structure(ref)}")
    for i, (o, r) in enumerate(zip(outs, refs)):
        if isinstance(o, Other):
            raise Verdict("incorrect", f"{where}: output {i} is a {o.type_name}, which cannot be checked "
                                       "(return tensors)")
        if not isinstance(r, TensorRef):
            continue
        if not isinstance(o, TensorRef):
            raise Verdict("incorrect", f"{where}: output {i} is {type(o).__name__}, not a tensor")
        if o.shape != r.shape:
            raise Verdict("shape_mismatch", f"{where}: output {i} has shape {o.shape}, expected {r.shape}")
        if o.dtype != r.dtype:
            raise Verdict("dtype_mismatch", f"{where}: output {i} has dtype torch.{o.dtype}, expected torch.{r.dtype}")
        if i < len(aliases) and aliases[i] is not None and (i >= len(ref_aliases) or ref_aliases[i] is None):
            raise Verdict("incorrect", f"{where}: output {i} aliases input {aliases[i]} (return a new tensor)")


def compare(out: Any, ref: Any, aliases: list[int | None], ref_aliases: list[int | None], *, atol: float,
            rtol: float, where: str) -> dict[str, float]:
    """Raise :class:`Verdict` unless the candidate's outputs ``out`` match the reference's ``ref``
    (both already read from the arenas). Returns the max/mean absolute differences."""
    outs, refs = leaves_of(out), leaves_of(ref)
    if len(outs) != len(refs) or structure(out) != structure(ref):
        raise Verdict("shape_mismatch", f"{where}: the candidate returned {len(outs)} output(s) shaped "
                                        f"{structure(out)}, the reference {len(refs)} shaped {structure(ref)}")
    max_diff = mean_diff = 0.0
    for i, (o, r) in enumerate(zip(outs, refs)):
        if isinstance(o, Other):
            raise Verdict("incorrect", f"{where}: output {i} is a {o.type_name}, which cannot be checked "
                                       "(return tensors)")
        if not isinstance(r, torch.Tensor):
            if isinstance(r, (int, float)) and not (isinstance(o, (int, float)) and not isinstance(o, torch.Tensor)
                                                    and math.isclose(o, r, rel_tol=rtol, abs_tol=atol)):
                raise Verdict("incorrect", f"{where}: output {i} is {o!r}, the reference {r!r}")
            continue
        if not isinstance(o, torch.Tensor):
            raise Verdict("incorrect", f"{where}: output {i} is {type(o).__name__}, not a tensor")
        if tuple(o.shape) != tuple(r.shape):
            raise Verdict("shape_mismatch", f"{where}: output {i} has shape {tuple(o.shape)}, expected {tuple(r.shape)}")
        if o.dtype != r.dtype:
            raise Verdict("dtype_mismatch", f"{where}: output {i} has dtype {o.dtype}, expected {r.dtype}")
        if i < len(aliases) and aliases[i] is not None and (i >= len(ref_aliases) or ref_aliases[i] is None):
            raise Verdict("incorrect", f"{where}: output {i} aliases input {aliases[i]} (return a new tensor)")
        if o.numel() == 0:
            continue
        o64, r64 = o.to(torch.float64) if not o.is_complex() else o, r.to(torch.float64) if not r.is_complex() else r
        diff = (o64 - r64).abs()
        finite = torch.isfinite(diff)
        md = float(diff[finite].max()) if bool(finite.any()) else 0.0
        mn = float(diff[finite].mean()) if bool(finite.any()) else 0.0
        max_diff, mean_diff = max(max_diff, md), max(mean_diff, mn)
        if not torch.allclose(o64, r64, atol=atol, rtol=rtol, equal_nan=True):
            raise Verdict("incorrect", f"{where}: output {i} differs from the reference (max abs diff {md:.3g}, "
                                       f"mean abs diff {mn:.3g}, atol={atol:g}, rtol={rtol:g})",
                          max_diff=md, mean_diff=mn)
        if r64.is_complex() or r.dtype == torch.bool:
            continue
        varies = r64.numel() > 1 and bool((r64.max() - r64.min()).abs() > atol)
        if varies and bool((o64.max() - o64.min()).abs() == 0):
            raise Verdict("incorrect", f"{where}: output {i} is constant where the reference is not")
        if torch.allclose(torch.zeros_like(r64), r64, atol=atol, rtol=rtol):
            # zeros would pass at this tolerance: demand a small relative error as well
            rel = float((o64 - r64).norm() / r64.norm().clamp_min(1e-30))
            if rel > 1e-2:
                raise Verdict("incorrect", f"{where}: output {i} has relative error {rel:.3g}; an all-zero output "
                                           "would pass the absolute tolerance here, so it is not enough")
    return {"max_diff": max_diff, "mean_diff": mean_diff}
