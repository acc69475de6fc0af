"""Timing shared by the benchmark scripts (each run as ``python benchmarks/bench_X.py``, so this
module is importable as ``_timing`` from the script's own folder)."""

from __future__ import annotations

import time
from typing import Any, Callable


def best_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """The fastest of ``repeats`` timed calls after ``warmup`` untimed ones: on a shared machine
    the minimum is the least noisy estimate of what the code itself costs."""
    return best_time_and_result(fn, repeats, warmup)[0]


def best_time_and_result(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> tuple[float, Any]:
    """Like :func:`best_time`, also returning the last call's result (to compare outputs)."""
    for _ in range(warmup):
        fn()
    times, out = [], None
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out
