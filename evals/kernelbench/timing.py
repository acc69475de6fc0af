"""Timing statistics of a KernelBench evaluation (computed in the parent from its own clocks).

Each batch of calls to an implementation has two steps, measured by the parent around its
requests (see ``judge.py``) on two clocks (the worker process's CPU time, read from the kernel,
and the parent's wall clock): *go* (the forwards: the step that is credited) and *collect* (the
outputs are written out). Collect is the same trusted work for every implementation, so whatever
an implementation's collect steps take at the median beyond the reference's is charged to it:
work moved out of the forward (handing back a lazy result and finishing it at collect time)
counts as forward time. The implementation is stopped at every other moment, so it has no third place to
work in.

The credited speedup is the ratio of *medians* (one stalled call on a busy machine moves a mean,
not a median); KernelBench's mean ratio is kept beside it. Its 90% confidence interval comes from
the order statistics of each side's median (distribution-free) and a systematic term (what two
processes running the same code differ by beyond that), combined for the ratio; a speedup whose
interval is wider than ``max_uncertainty`` (relative half-width) is re-timed once when more
samples can make it, then marked unstable, and no reward may use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallTime:
    """Nanoseconds of one batch's three steps on one clock (the worker's CPU time, or the wall
    time of the parent's round trip)."""

    go: int
    collect: int


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def credited(calls: list[CallTime], baseline: list[CallTime]) -> list[int]:
    """Forward time of each batch plus what its collect steps took, at the median, beyond
    ``baseline``'s median (the reference's own batches): see the module docstring. The charge is
    one figure for all batches (a difference of medians): per batch it would add the collect
    step's own noise to every sample."""
    if not calls:
        return []
    charge = max(0.0, _median([c.collect for c in calls]) - _median([c.collect for c in baseline])) if baseline else 0.0
    return [int(c.go + charge) for c in calls]


def stats(ns: list[int]) -> dict[str, Any]:
    """Milliseconds: mean, median, std, min, max, q25, q75, spread (IQR / median), num_trials."""
    ms = [n / 1e6 for n in ns]
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((x - mean) ** 2 for x in ms) / max(1, len(ms) - 1))
    med = _median(ms)
    q25, q75 = _quantile(ms, 0.25), _quantile(ms, 0.75)
    return {"mean": mean, "median": med, "std": std, "min": min(ms), "max": max(ms), "q25": q25, "q75": q75,
            "spread": (q75 - q25) / med if med > 0 else 0.0, "num_trials": len(ms)}


def speedups(ref: dict[str, Any], cand: dict[str, Any]) -> tuple[float, float]:
    """(median ratio, mean ratio): reference time over candidate time."""
    return ref["median"] / max(cand["median"], 1e-9), ref["mean"] / max(cand["mean"], 1e-9)


def median_halfwidth(ns: list[int], z: float = 1.645) -> float:
    """Relative half-width of a distribution-free confidence interval for the median: the order
    statistics at n/2 -/+ z*sqrt(n)/2 (normal approximation of Binomial(n, 1/2); z=1.645: 90%)."""
    xs = sorted(ns)
    n = len(xs)
    med = _median([float(x) for x in xs])
    if n < 2 or med <= 0:
        return float("inf")
    lo = max(0, math.floor(n / 2 - z * math.sqrt(n) / 2))
    hi = min(n - 1, math.ceil(n / 2 + z * math.sqrt(n) / 2) - 1)
    return (xs[hi] - xs[lo]) / (2 * med)


#: Between two processes running the same code, medians differ by more than their samples say
#: (memory placement, caches). Measured with the reference as its own candidate on 88 KernelBench
#: level-1 problems at scale 1/64 (2-vCPU VM, load ~5): among the results whose statistical
#: interval was within +/-10%, log-speedups spread with sd 0.070 where their intervals accounted
#: for 0.047, so 0.05 at one sigma. Added in quadrature, so that an interval says what a rerun
#: may give.
SYSTEMATIC = 0.05


def speedup_interval(speedup: float, ref_ns: list[int], cand_ns: list[int]) -> tuple[float, float, float]:
    """(low, high, relative half-width) of a ~90% interval for a ratio of medians: both medians'
    distribution-free intervals and the systematic term, combined in quadrature."""
    hw = math.sqrt(median_halfwidth(ref_ns) ** 2 + median_halfwidth(cand_ns) ** 2 + (1.645 * SYSTEMATIC) ** 2)
    return speedup * max(0.0, 1 - hw), speedup * (1 + hw), hw
