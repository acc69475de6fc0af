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


def _closeness(o: torch.Tensor, r: torch.Tensor, atol: float, rtol: float) -> tuple[bool, float, float, torch.Tensor]:
    """``torch.allclose(o, r, rtol, atol, equal_nan=True)`` in one pass over the data in the common
    case (allclose itself makes several and allocates at each), with the max and mean absolute
    difference over finite elements, and the difference tensor."""
    if not (o.is_floating_point() or o.is_complex()):
        o, r = o.to(torch.float64), r.to(torch.float64)  # integers and bools: exact below 2**53
    diff = (o - r).abs()
    ok = bool((diff <= r.abs().mul_(rtol).add_(atol)).all())
    if not ok:  # allclose also calls equal values close (infinities) and, with equal_nan, two NaNs
        bad = ~(diff <= r.abs().mul_(rtol).add_(atol))
        ob, rb = o[bad], r[bad]
        ok = bool(((ob == rb) | (ob.isnan() & rb.isnan())).all())
    md = float(diff.max())
    if math.isfinite(md):  # the max of anything with a NaN or an infinity is not finite
        return ok, md, float(diff.mean()), diff
    finite = torch.isfinite(diff)
    if bool(finite.any()):
        return ok, float(diff[finite].max()), float(diff[finite].mean()), diff
    return ok, 0.0, 0.0, diff


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
        ok, md, mn, diff = _closeness(o, r, atol, rtol)
        max_diff, mean_diff = max(max_diff, md), max(mean_diff, mn)
        if not ok:
            raise Verdict("incorrect", f"{where}: output {i} differs from the reference (max abs diff {md:.3g}, "
                                       f"mean abs diff {mn:.3g}, atol={atol:g}, rtol={rtol:g})",
                          max_diff=md, mean_diff=mn)
        if r.is_complex() or r.dtype == torch.bool:
            continue
        r_lo, r_hi = (float(v) for v in r.aminmax())
        if r.numel() > 1 and r_hi - r_lo > atol:
            o_lo, o_hi = (float(v) for v in o.aminmax())
            if o_hi == o_lo:
                raise Verdict("incorrect", f"{where}: output {i} is constant where the reference is not")
        if max(abs(r_lo), abs(r_hi)) <= atol:
            # zeros would pass at this tolerance: demand a small relative error as well
            rel = float(diff.double().norm() / r.double().norm().clamp_min(1e-30))
            if rel > 1e-2:
                raise Verdict("incorrect", f"{where}: output {i} has relative error {rel:.3g}; an all-zero output "
                                           "would pass the absolute tolerance here, so it is not enough")
    return {"max_diff": max_diff, "mean_diff": mean_diff}
