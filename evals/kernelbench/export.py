"""KernelBench-style ``eval_results.json`` and a plot of the speedup distribution.

The JSON follows upstream's ``scripts/eval_from_generations.py``: ``{"<problem_id>": [{sample_id,
compiled, correctness, metadata, runtime, runtime_stats, ref_runtime}, ...]}``, one file per level
(KernelBench runs are per level). Times are ms; ``runtime`` is the mean, -1.0 when not timed.
Our own fields (status, scale, speedup, suspicious) ride in ``metadata``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from closedloop.evals.kernelbench.evaluate import KernelResult


class KernelBenchEntry(BaseModel):
    """One sample in upstream's ``eval_results.json``; the field names are upstream's, so tools
    written for KernelBench read our files."""

    sample_id: int
    compiled: bool
    correctness: bool
    metadata: dict[str, Any]  # upstream's free-form bag; its keys vary with the status
    runtime: float  # candidate mean, ms; -1.0 when not timed
    runtime_stats: dict[str, float]
    ref_runtime: float  # reference mean, ms; -1.0 when not timed


def kernelbench_entry(r: KernelResult) -> KernelBenchEntry:
    compiled = r.status not in ("compile_error", "load_error", "policy_violation")
    cand = r.timings.get("candidate", {})
    ref = r.timings.get("reference", {})
    meta: dict[str, Any] = {"status": r.status, "message": r.message[:2000], "backend": r.backend, "scale": r.scale,
            "scaled_constants": r.scaled_constants, "speedup": r.speedup, "speedup_mean": r.speedup_mean,
            "speedup_ci": r.speedup_ci, "timing_unstable": r.timing_unstable, "max_difference": r.max_diff,
            "avg_difference": r.mean_diff, "hardware": "cpu" if r.backend == "cpu" else None, "device": r.backend}
    if r.status == "compile_error":
        meta["compilation_error"] = (r.compiler_log or r.message)[-2000:]
    elif r.status in ("runtime_error", "timeout", "invalid_output"):
        meta["runtime_error"] = (r.traceback_tail or r.message)[-2000:]
    if r.status == "suspicious":
        meta["excessive_speedup"] = True
    if not r.timed:
        meta["not_timed"] = r.not_timed_reason or "not timed"
    stats = {k: cand[k] for k in ("mean", "std", "min", "max", "num_trials", "median") if k in cand}
    return KernelBenchEntry(sample_id=r.sample_id, compiled=compiled, correctness=r.correct, metadata=meta,
                            runtime=cand.get("mean", -1.0) if r.timed else -1.0, runtime_stats=stats,
                            ref_runtime=ref.get("mean", -1.0) if r.timed else -1.0)


def write_eval_results(results: Iterable[KernelResult], path: str | Path) -> dict[int, Path]:
    """Write ``eval_results.json`` (one level) or ``eval_results_level<N>.json`` per level when the
    results span several; returns {level: path}."""
    by_level: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in sorted(results, key=lambda r: (r.level, r.problem_id, r.sample_id)):
        by_level[r.level][str(r.problem_id)].append(kernelbench_entry(r).model_dump())
    path = Path(path)
    out: dict[int, Path] = {}
    for level, data in by_level.items():
        p = path if len(by_level) == 1 else path.with_name(f"{path.stem}_level{level}{path.suffix}")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(data, indent=2))
        out[level] = p
    return out


def plot_speedups(results: Sequence[KernelResult], path: str | Path) -> Path | None:
    """A histogram of log2 speedups of correct samples (suspicious ones marked). None (and nothing
    written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import math

    ok = [r.speedup for r in results if r.status == "correct" and r.speedup]
    sus = [r.speedup for r in results if r.status == "suspicious" and r.speedup]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bins = 20
    if ok:
        ax.hist([math.log2(s) for s in ok], bins=bins, color="tab:blue", alpha=0.8, label=f"correct ({len(ok)})")
    if sus:
        ax.hist([math.log2(s) for s in sus], bins=bins, color="tab:red", alpha=0.8, label=f"suspicious ({len(sus)})")
    ax.axvline(0.0, color="k", lw=1, ls="--")
    ax.set_xlabel("log2 speedup over eager torch")
    ax.set_ylabel("samples")
    ax.set_title("Speedup distribution")
    if ok or sus:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
