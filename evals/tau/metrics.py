"""pass^k and friends over repeated trials.

pass^k = mean over tasks of C(c_t, k) / C(n_t, k): the chance that k trials drawn without
replacement from task t's n_t trials all succeed (c_t successes; success = reward within 1e-6
of 1). This is the unbiased estimator used by tau-bench and tau2.

Trials that cannot say anything about the agent are set apart, listed, and excluded:
infrastructure errors and ungraded episodes (reward ``None``). A task left with fewer than k
trials has no estimate for that k: it is excluded from pass^k and listed under
``insufficient[k]`` (tau2 instead caps k at the smallest trial count; we keep every requested k
and say which tasks it covers, via ``num_tasks[k]``).
"""

from __future__ import annotations

from collections import defaultdict
from math import comb
from typing import Iterable

from pydantic import BaseModel, Field

from closedloop.evals.tau.simulation import SimulationRun, TerminationReason

__all__ = ["Trial", "TauMetrics", "pass_hat_k", "compute_metrics", "is_success"]

SUCCESS_TOL = 1e-6


def is_success(reward: float) -> bool:
    return abs(reward - 1.0) <= SUCCESS_TOL


class Trial(BaseModel):
    task_id: str
    reward: float | None
    termination_reason: TerminationReason | None = None
    simulation_id: str | None = None

    @classmethod
    def from_simulation(cls, sim: SimulationRun) -> "Trial":
        reward = sim.reward_info.reward if sim.reward_info is not None else None
        return cls(task_id=sim.task_id, reward=reward, termination_reason=sim.termination_reason,
                   simulation_id=sim.id)


class TauMetrics(BaseModel):
    pass_hat_k: dict[int, float] = Field(default_factory=dict)
    num_tasks: dict[int, int] = Field(default_factory=dict)          # tasks that enter pass^k for each k
    insufficient: dict[int, list[str]] = Field(default_factory=dict)  # tasks with fewer than k usable trials
    avg_reward: float | None = None
    num_trials: int = 0                                               # usable trials
    infrastructure_errors: list[str] = Field(default_factory=list)   # simulation ids (or task ids)
    ungraded: list[str] = Field(default_factory=list)


def pass_hat_k(successes: int, trials: int, k: int) -> float:
    """C(c, k) / C(n, k) for one task; raises when n < k (there is no estimate)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes ({successes}) must be between 0 and trials ({trials})")
    if trials < k:
        raise ValueError(f"pass^{k} needs at least {k} trials, the task has {trials}")
    return comb(successes, k) / comb(trials, k)


def compute_metrics(trials: Iterable[Trial | SimulationRun], ks: Iterable[int] | None = None) -> TauMetrics:
    """Metrics over trials; ``ks`` defaults to 1..max trials per task."""
    by_task: dict[str, list[float]] = defaultdict(list)
    out = TauMetrics()
    for t in trials:
        trial = Trial.from_simulation(t) if isinstance(t, SimulationRun) else t
        label = trial.simulation_id or trial.task_id
        if trial.termination_reason == TerminationReason.INFRASTRUCTURE_ERROR:
            out.infrastructure_errors.append(label)
            continue
        if trial.reward is None:
            out.ungraded.append(label)
            continue
        by_task[trial.task_id].append(trial.reward)
    out.num_trials = sum(len(v) for v in by_task.values())
    if out.num_trials:
        out.avg_reward = sum(sum(v) for v in by_task.values()) / out.num_trials
    max_n = max((len(v) for v in by_task.values()), default=0)
    for k in (sorted(set(ks)) if ks is not None else range(1, max_n + 1)):
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        values, short = [], []
        for task_id, rewards in sorted(by_task.items()):
            if len(rewards) < k:
                short.append(task_id)
                continue
            values.append(pass_hat_k(sum(is_success(r) for r in rewards), len(rewards), k))
        out.insufficient[k] = short
        out.num_tasks[k] = len(values)
        if values:
            out.pass_hat_k[k] = sum(values) / len(values)
    return out
