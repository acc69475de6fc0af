"""pass^k and friends over repeated trials, by tau2's conventions unless asked otherwise.

pass^k = mean over tasks of C(c_t, k) / C(n_t, k): the chance that k trials drawn without
replacement from task t's n_t trials all succeed (c_t successes; success = reward within 1e-6
of 1). This is the unbiased estimator used by tau-bench and tau2.

By default the figures are tau2's ``compute_metrics`` (``tau2.metrics.agent_metrics``) exactly:

- infrastructure errors are set apart, listed, and excluded;
- an ungraded episode (reward ``None``: no judge, or a judge that could not answer; tau2 reads it
  as ``reward_info: null``) counts as a failure in pass^k and is left out of ``avg_reward``
  (pandas' mean skips it);
- k runs up to the smallest number of trials any task has (tau2 caps k there; a requested k
  above the cap gets no pass^k, and ``insufficient[k]`` names the tasks that are short).

Two documented alternatives (:class:`~closedloop.evals.tau.conventions.Conventions`), recorded
with the figures (``TauMetrics.conventions``):

- ``ungraded="exclude"``: an ungraded episode is left out of pass^k too; it says nothing about the
  agent, so counting it as a failure biases pass^k down by however many episodes went unjudged;
- ``pass_k="per-task"``: every requested k is computed over the tasks that have at least k usable
  trials (``num_tasks[k]`` says how many), so one short task does not remove pass^k for all.
"""

from __future__ import annotations

from collections import defaultdict
from math import comb
from typing import Any, Iterable

from pydantic import BaseModel, Field

from closedloop.evals.tau.conventions import Conventions
from closedloop.evals.tau.simulation import SimulationRun, TerminationReason

__all__ = ["Trial", "TauMetrics", "pass_hat_k", "compute_metrics", "results_metrics", "is_success"]

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
    insufficient: dict[int, list[str]] = Field(default_factory=dict)  # tasks with fewer than k trials in pass^k
    avg_reward: float | None = None                                   # over graded episodes
    num_graded: int = 0                                               # episodes with a reward
    num_trials: int = 0                                               # episodes in pass^k
    infrastructure_errors: list[str] = Field(default_factory=list)   # simulation ids (or task ids)
    ungraded: list[str] = Field(default_factory=list)
    conventions: Conventions = Field(default_factory=Conventions)


def pass_hat_k(successes: int, trials: int, k: int) -> float:
    """C(c, k) / C(n, k) for one task; raises when n < k (there is no estimate)."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes ({successes}) must be between 0 and trials ({trials})")
    if trials < k:
        raise ValueError(f"pass^{k} needs at least {k} trials, the task has {trials}")
    return comb(successes, k) / comb(trials, k)


def compute_metrics(trials: Iterable[Trial | SimulationRun], ks: Iterable[int] | None = None, *,
                    conventions: Conventions | None = None) -> TauMetrics:
    """Metrics over trials. ``ks`` are the k asked for (a run passes 1..its trials, as tau2 reads
    ``info.num_trials``); without them, 1..the most trials any task has. With tau2's ``capped``
    convention only those up to the smallest trial count are computed."""
    conventions = conventions or Conventions()
    by_task: dict[str, list[bool]] = defaultdict(list)  # success of each trial in pass^k
    rewards: list[float] = []
    out = TauMetrics(conventions=conventions)
    for t in trials:
        trial = Trial.from_simulation(t) if isinstance(t, SimulationRun) else t
        label = trial.simulation_id or trial.task_id
        if trial.termination_reason == TerminationReason.INFRASTRUCTURE_ERROR:
            out.infrastructure_errors.append(label)
            continue
        if trial.reward is None:
            out.ungraded.append(label)
            if conventions.ungraded == "fail":
                by_task[trial.task_id].append(False)
            continue
        rewards.append(trial.reward)
        by_task[trial.task_id].append(is_success(trial.reward))
    out.num_graded = len(rewards)
    out.num_trials = sum(len(v) for v in by_task.values())
    if rewards:
        out.avg_reward = sum(rewards) / len(rewards)
    counts = [len(v) for v in by_task.values()]
    wanted = sorted(set(ks)) if ks is not None else list(range(1, max(counts, default=0) + 1))
    cap = min(counts, default=0) if conventions.pass_k == "capped" else None
    for k in wanted:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        out.insufficient[k] = sorted(task for task, s in by_task.items() if len(s) < k)
        if cap is not None and k > cap:
            out.num_tasks[k] = 0  # tau2: no pass^k above the smallest trial count
            continue
        values = [pass_hat_k(sum(s), len(s), k) for task, s in sorted(by_task.items()) if len(s) >= k]
        out.num_tasks[k] = len(values)
        if values:
            out.pass_hat_k[k] = sum(values) / len(values)
    return out


def results_metrics(trials: Iterable[Trial | SimulationRun], info: dict[str, Any], **overrides: Any) -> TauMetrics:
    """A results file's metrics as tau2's ``compute_metrics`` reads the file: k up to its
    ``info.num_trials`` (then capped by the data, as the conventions say), and the conventions
    the file records (``info.conventions``; tau2's when it records none) with ``overrides``
    (convention fields) applied."""
    recorded = info.get("conventions")
    conventions = Conventions.model_validate({**(recorded if isinstance(recorded, dict) else {}), **overrides})
    num_trials = info.get("num_trials")
    ks = range(1, num_trials + 1) if isinstance(num_trials, int) and num_trials > 0 else None
    return compute_metrics(trials, ks, conventions=conventions)
