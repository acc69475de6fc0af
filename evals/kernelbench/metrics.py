"""KernelBench metrics: fast_p, geometric-mean speedup, pass@k.

fast_p follows KernelBench (``src/kernelbench/score.py``): the fraction of *all* problems whose
sample is correct **and** has speedup strictly greater than p (so fast_0 is the correctness
rate). Our deliberate differences: a ``suspicious`` sample (correct, but faster than the
suspicious-speedup bound) is not counted until a reviewer marks it, and samples that were not
timed (no GPU for CUDA/Triton) or whose timing was too noisy to credit (``timing_unstable``)
count for fast_0 only. With several samples per problem, the
problem's best sample (correct first, then fastest) is used, as an agent's final answer would be.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Set as AbstractSet
from typing import Any

from closedloop.evals.kernelbench.evaluate import KernelResult

P_VALUES = (0.0, 0.5, 0.8, 1.0, 1.5, 2.0)


def _counts(res: KernelResult, reviewed: AbstractSet[tuple[str, int]]) -> bool:
    return res.status == "correct" or (res.status == "suspicious" and (res.problem, res.sample_id) in reviewed)


def _speedup(res: KernelResult) -> float | None:
    """The speedup a metric may use: none when the timing was too noisy to credit."""
    return None if res.timing_unstable else res.speedup


def best_per_problem(results: Iterable[KernelResult], reviewed: AbstractSet[tuple[str, int]] = frozenset()) -> dict[str, KernelResult]:
    best: dict[str, KernelResult] = {}
    for r in results:
        b = best.get(r.problem)
        key = (_counts(r, reviewed), _speedup(r) or 0.0)
        if b is None or key > (_counts(b, reviewed), _speedup(b) or 0.0):
            best[r.problem] = r
    return best


def fast_p(results: Iterable[KernelResult], p: float, *, num_problems: int | None = None,
           reviewed: AbstractSet[tuple[str, int]] = frozenset()) -> float:
    """Fraction of problems (``num_problems``, default: those with results) that are correct with
    speedup > p. Untimed correct samples count only for p = 0."""
    best = best_per_problem(results, reviewed)
    n = num_problems if num_problems is not None else len(best)
    if n == 0:
        return 0.0
    hits = 0
    for r in best.values():
        if not _counts(r, reviewed):
            continue
        sp = _speedup(r)
        if p == 0.0 and sp is None:
            hits += 1
        elif sp is not None and sp > p:
            hits += 1
    return hits / n


def geomean_speedup(results: Iterable[KernelResult], reviewed: AbstractSet[tuple[str, int]] = frozenset()) -> float | None:
    """Geometric mean of speedups over correct (timed) samples; None when there are none."""
    sp = [s for r in results if _counts(r, reviewed) and (s := _speedup(r)) and s > 0]
    if not sp:
        return None
    return math.exp(sum(math.log(s) for s in sp) / len(sp))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"k={k} exceeds the {n} samples")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def summarize(results: list[KernelResult], *, num_problems: int | None = None, ks: Iterable[int] = (1,),
              reviewed: AbstractSet[tuple[str, int]] = frozenset()) -> dict[str, Any]:
    """The run's summary document (stored with the run, printed by the CLI): counts, fast_p,
    geomean speedup, pass@k for each k, statuses, and the suspicious samples awaiting review."""
    by_problem: dict[str, list[KernelResult]] = defaultdict(list)
    for r in results:
        by_problem[r.problem].append(r)
    statuses: dict[str, int] = defaultdict(int)
    for r in results:
        statuses[r.status] += 1
    n_problems = num_problems if num_problems is not None else len(by_problem)
    pk = {}
    for k in ks:
        vals = [pass_at_k(len(rs), sum(_counts(r, reviewed) for r in rs), k) for rs in by_problem.values()
                if len(rs) >= k]
        pk[f"pass@{k}"] = (sum(vals) / n_problems) if vals and n_problems else None
    return {
        "num_problems": n_problems,
        "num_samples": len(results),
        "fast_p": {f"fast_{p:g}": fast_p(results, p, num_problems=n_problems, reviewed=reviewed) for p in P_VALUES},
        "geomean_speedup": geomean_speedup(results, reviewed),
        **pk,
        "statuses": dict(sorted(statuses.items())),
        "suspicious": [[r.problem, r.sample_id, r.speedup] for r in results if r.status == "suspicious"],
    }
