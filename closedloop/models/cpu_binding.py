"""Which CPUs a CPU-decoding engine process and its server get (``closedloop serve --engine-cpus``).

Why: with the model in a child process (:mod:`closedloop.models.engine_process`), the scheduler
moves the decode thread between cores as the server's threads and the load come and go, and every
move costs it its caches. On a 2-core machine at 32 clients, giving the engine one core and the
server the other served 22-27% more requests per second than leaving placement to the scheduler
(``benchmarks/bench_serve.py --peer none --concurrency 32`` with and without ``--engine-cpus none``,
medians of 4 interleaved runs: 455 vs 359 with the prompt cache, 467 vs 384 without). vLLM's CPU backend binds its engine threads to cores for the same
reason (``VLLM_CPU_OMP_THREADS_BIND``). Linux only (``os.sched_setaffinity``); elsewhere nothing
is bound.
"""

from __future__ import annotations

import os
from typing import Sequence


def available_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def split_cpus(engine_threads: int | None, cpus: Sequence[int] | None = None) -> tuple[list[int], list[int]] | None:
    """``(engine CPUs, server CPUs)``: the engine gets the last ``engine_threads`` CPUs (default:
    all but one), the server the rest; ``None`` when there are fewer than two CPUs or the engine
    would get them all (then nothing is worth binding)."""
    cpus = list(cpus) if cpus is not None else available_cpus()
    if len(cpus) < 2:
        return None
    k = engine_threads if engine_threads is not None else len(cpus) - 1
    if k < 1 or k >= len(cpus):
        return None
    return cpus[-k:], cpus[:-k]


def bind_this_process(cpus: Sequence[int]) -> None:
    """Restrict every thread of this process (and the threads and children it starts later) to ``cpus``."""
    if not hasattr(os, "sched_setaffinity") or not cpus:
        return
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
