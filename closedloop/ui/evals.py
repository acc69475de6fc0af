"""What the evaluation page shows, per benchmark, read from an evaluation's parent run and its children.

- τ-bench (children of kind ``episode`` holding the simulation): pass^k overall (the benchmark's
  own :func:`~closedloop.evals.tau.metrics.compute_metrics`) and per task, the mean of each reward
  criterion, and each episode's failing checks, one record per (task, trial) as the runner keeps it
  (:func:`~closedloop.evals.tau.eval_store.latest_episodes`).
- KernelBench (children of kind ``kernel_sample``): status distribution, speedups, and per sample
  its verdict (compiler log, traceback, code on the sample's trace page).
- FactGuard (``config.benchmark == "factguard"``): the metrics its runner stored on the parent.
- anything else (the demo's evaluations): the parent's summary and the children's mean rewards.

Each kind also gives flat ``metrics`` and per-item ``items`` (task, problem, seed ...) so two
evaluations compare side by side whatever they measured.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from closedloop.store import RunRecord, RunStore, RunSummary

__all__ = ["EvalView", "eval_view", "flatten", "failing_checks", "KERNEL_SAMPLE_KIND", "TAU_EPISODE_KIND"]

TAU_EPISODE_KIND = "episode"
KERNEL_SAMPLE_KIND = "kernel_sample"


@dataclass
class EvalView:
    run: RunSummary
    benchmark: str  # "tau" | "kernelbench" | "factguard" | "generic"
    metrics: dict[str, float] = field(default_factory=dict)  # flat, for the header and comparisons
    items: dict[str, float] = field(default_factory=dict)  # per task/problem/seed, for comparisons
    item_label: str = "item"
    tables: dict[str, Any] = field(default_factory=dict)  # benchmark-specific, read by its template
    charts: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def flatten(value: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts as ``a.b.c -> float`` (booleans as 0/1, short numeric lists such
    as confidence intervals as ``a[0]``, ``a[1]``; other lists skipped)."""
    out: dict[str, float] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(value, (list, tuple)) and 0 < len(value) <= 4 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        for i, v in enumerate(value):  # an interval: accuracy_ci[0], accuracy_ci[1]
            out[f"{prefix[:-1]}[{i}]"] = float(v)
    elif isinstance(value, bool):
        out[prefix[:-1]] = float(value)
    elif isinstance(value, (int, float)) and math.isfinite(float(value)):
        out[prefix[:-1]] = float(value)
    return out


def eval_view(store: RunStore, run_id: str) -> EvalView:
    parent = store.get_run(run_id, media="refs")
    kids = store.list_runs(limit=None, parent_id=parent.id)
    kinds = Counter(k.kind for k in kids)
    if kinds.get(TAU_EPISODE_KIND):
        return _tau(store, parent)
    if kinds.get(KERNEL_SAMPLE_KIND):
        return _kernelbench(parent, [k for k in kids if k.kind == KERNEL_SAMPLE_KIND])
    if (parent.config or {}).get("benchmark") == "factguard" or "factguard" in parent.tags:
        return _generic(parent, kids, "factguard")
    return _generic(parent, kids, "generic")


def _summary(run: RunRecord) -> RunSummary:
    return RunSummary(**run.model_dump(exclude={"messages", "turns", "tool_calls"}))


def failing_checks(info: Any) -> list[str]:
    """Every check of a τ grade that did not pass, as one line each."""
    if info is None:
        return ["not graded"]
    out = [f"not graded: {k.value if hasattr(k, 'value') else k}: {why}" for k, why in (info.not_graded or {}).items()]
    if info.db_check is not None and not info.db_check.db_match:
        out.append("DB: final database differs from the gold replay")
    for c in info.env_assertions or []:
        if not c.met:
            out.append(f"ENV_ASSERTION: {c.env_assertion.func_name}({c.env_assertion.arguments}) not met"
                       + (f" ({c.error})" if c.error else ""))
    for c in info.action_checks or []:
        if not c.action_match:
            out.append(f"ACTION: expected {c.action.name}({c.action.arguments}) not taken")
    for c in info.nl_assertions or []:
        if not c.met:
            out.append(f"NL_ASSERTION: {c.nl_assertion} ({c.justification})")
    for c in info.communicate_checks or []:
        if not c.met:
            out.append(f"COMMUNICATE: {c.info!r} not said to the user")
    return out


def _tau(store: RunStore, parent: RunRecord) -> EvalView:
    from closedloop.evals.tau.eval_store import latest_episodes, load_episodes
    from closedloop.evals.tau.metrics import compute_metrics, is_success, pass_hat_k

    records = latest_episodes(load_episodes(store, parent.id))
    metrics = compute_metrics([r.simulation for r in records])
    view = EvalView(_summary(parent), "tau", item_label="task")
    for k, v in metrics.pass_hat_k.items():
        view.metrics[f"pass^{k}"] = v
    if metrics.avg_reward is not None:
        view.metrics["avg_reward"] = metrics.avg_reward
    view.metrics["trials"] = float(metrics.num_trials)
    by_task: dict[str, list[float]] = defaultdict(list)
    crit_task: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    crit_all: dict[str, list[float]] = defaultdict(list)
    episodes = []
    for r in sorted(records, key=lambda r: (r.simulation.task_id, r.simulation.trial or 0)):
        sim = r.simulation
        info = sim.reward_info
        if info is not None and info.reward is not None:
            by_task[sim.task_id].append(info.reward)
            for comp, value in (info.reward_breakdown or {}).items():
                name = comp.value if hasattr(comp, "value") else str(comp)
                crit_task[sim.task_id][name].append(value)
                crit_all[name].append(value)
        episodes.append({"run_id": r.run_id, "task": sim.task_id, "trial": sim.trial,
                         "reward": None if info is None else info.reward,
                         "termination": sim.termination_reason.value, "failing": failing_checks(info)})
    max_n = max((len(v) for v in by_task.values()), default=0)
    ks = list(range(1, max_n + 1))
    tasks = []
    for task, rewards in sorted(by_task.items()):
        c = sum(is_success(x) for x in rewards)
        tasks.append({"task": task, "trials": len(rewards), "successes": c,
                      "pass": {k: pass_hat_k(c, len(rewards), k) for k in ks if k <= len(rewards)},
                      "criteria": {n: sum(v) / len(v) for n, v in crit_task[task].items()}})
        view.items[task] = sum(is_success(x) for x in rewards) / len(rewards)
    view.tables = {"ks": ks, "tasks": tasks, "episodes": episodes,
                   "criteria": {n: sum(v) / len(v) for n, v in sorted(crit_all.items())},
                   "infrastructure_errors": metrics.infrastructure_errors, "ungraded": metrics.ungraded}
    for n, v in view.tables["criteria"].items():
        view.metrics[f"criterion.{n}"] = v
    return view


def _latest_samples(kids: list[RunSummary]) -> list[RunSummary]:
    """One record per (problem, sample): the latest graded one, else the latest at all (the
    runner's rule: an infrastructure error is kept only if nothing better was stored)."""
    best: dict[tuple[Any, Any], RunSummary] = {}
    for run in sorted(kids, key=lambda r: r.started_at):
        out = run.outcome or {}
        key = (out.get("problem"), out.get("sample_id"))
        prev = best.get(key)
        if prev is None or (prev.outcome or {}).get("outcome") == "infra_error" or out.get("outcome") != "infra_error":
            best[key] = run
    return list(best.values())


def _kernelbench(parent: RunRecord, kids: list[RunSummary]) -> EvalView:
    from closedloop.ui.charts import bars, histogram

    view = EvalView(_summary(parent), "kernelbench", item_label="problem")
    samples = []
    statuses: Counter[str] = Counter()
    speedups = []
    per_problem: dict[str, float] = {}
    for run in sorted(_latest_samples(kids), key=lambda r: (str((r.outcome or {}).get("problem")),
                                                            (r.outcome or {}).get("sample_id") or 0)):
        out = run.outcome or {}
        res = out.get("result") or {}
        status = res.get("status") or out.get("outcome") or run.status
        statuses[status] += 1
        speedup = res.get("speedup")
        correct = status in ("correct", "suspicious")
        if correct and isinstance(speedup, (int, float)):
            speedups.append(float(speedup))
        problem = str(out.get("problem"))
        value = float(speedup) if correct and isinstance(speedup, (int, float)) else 0.0
        per_problem[problem] = max(per_problem.get(problem, 0.0), value)
        samples.append({"run_id": run.id, "problem": problem, "sample": out.get("sample_id"), "status": status,
                        "speedup": speedup, "message": (res.get("message") or out.get("error") or "")[:300]})
    n = len(samples)
    view.metrics = {"samples": float(n), "correct": sum(statuses[s] for s in ("correct", "suspicious")) / max(n, 1)}
    summary = (parent.outcome or {}).get("summary") or {}
    view.metrics.update({f"summary.{k}": v for k, v in flatten(summary).items()})
    view.items = per_problem
    view.tables = {"samples": samples, "statuses": statuses.most_common()}
    view.charts = [bars("status of each sample", statuses.most_common())]
    if speedups:
        view.charts.append(histogram("speedup of correct samples (log bins)", speedups, log=True, unit="×"))
    else:
        view.notes.append("no correct sample has a speedup (nothing timed, or nothing correct)")
    return view


def _generic(parent: RunRecord, kids: list[RunSummary], benchmark: str) -> EvalView:
    view = EvalView(_summary(parent), benchmark, item_label="episode")
    outcome = parent.outcome or {}
    view.metrics = flatten({k: v for k, v in outcome.items() if k != "rewards"})
    sums: dict[str, list[float]] = defaultdict(list)
    episodes = []
    for i, run in enumerate(kids):
        rewards = {k: float(v) for k, v in ((run.outcome or {}).get("rewards") or {}).items()
                   if isinstance(v, (int, float))}
        for k, v in rewards.items():
            sums[k].append(v)
        meta = run.metadata or {}
        key = str(meta.get("sample") or meta.get("seed") or (run.config or {}).get("task_id") or i)
        view.items[key] = sum(rewards.values())
        episodes.append({"run_id": run.id, "key": key, "status": run.status, "rewards": rewards})
    for k, vs in sorted(sums.items()):
        view.metrics[f"mean reward.{k}"] = sum(vs) / len(vs)
    view.tables = {"episodes": episodes}
    return view
