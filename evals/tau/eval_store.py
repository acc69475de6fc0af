"""A τ evaluation's records in the run store: one parent run per evaluation, one child per episode.

The parent (kind ``eval``, tagged ``eval:<name>``) is the evaluation's identity across crashes: a
resume reopens it rather than starting a new one, so ``closedloop runs list`` shows one eval that
went ``killed``/``interrupted`` → ``running`` → ``completed``. Each finished episode is one child
(kind ``episode``) written in a single transaction together with its messages, token-exact agent
turns and outcome (the full :class:`SimulationRun` with its :class:`RewardInfo`). An episode that
was running when the process died has no row at all, so a resume re-runs exactly the episodes
that are missing; nothing is half-written and nothing is counted twice.

Children whose episode must be run again (infrastructure error, grading failure) are stored with
status ``failed``: they stay in the store as a record of what went wrong, and :func:`latest_episodes`
prefers a later good attempt of the same (task, trial) over them.

Both go through the store's public API: ``RunStore.record_trajectory`` (one transaction, with a
parent) and ``RunStore.reopen_run``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from closedloop.evals.tau.simulation import SimulationRun, TerminationReason
from closedloop.messages import Trajectory
from closedloop.store import RunStore, RunSummary

__all__ = ["EVAL_KIND", "EPISODE_KIND", "EpisodeRecord", "name_tag", "find_eval", "open_eval", "reopen_eval",
           "record_episode", "episode_outcome", "load_episodes", "latest_episodes", "needs_rerun"]

EVAL_KIND = "eval"
EPISODE_KIND = "episode"


def name_tag(name: str) -> str:
    return f"eval:{name}"


@dataclass
class EpisodeRecord:
    """One stored episode: its run id, status and the simulation it holds."""

    run_id: str
    status: str
    started_at: datetime
    simulation: SimulationRun

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.simulation.task_id, self.simulation.trial)


def needs_rerun(sim: SimulationRun) -> bool:
    """Episodes that say nothing about the agent and are run again on resume."""
    return sim.termination_reason == TerminationReason.INFRASTRUCTURE_ERROR or sim.reward_info is None


def find_eval(store: RunStore, name: str) -> RunSummary | None:
    """The eval parent named ``name`` (newest if, against expectation, there are several)."""
    runs = store.list_runs(limit=None, kind=EVAL_KIND, tag=name_tag(name))
    return runs[0] if runs else None


def open_eval(store: RunStore, name: str, config: dict[str, Any], *, graph: str | None,
              model_spec: str | None) -> str:
    return store.start_run(kind=EVAL_KIND, graph=graph, model_spec=model_spec, config=config,
                           tags=[name_tag(name)], metadata={"name": name, "attempts": 1})


def reopen_eval(store: RunStore, run_id: str, config: dict[str, Any]) -> None:
    """Make a finished eval parent ``running`` again, owned by this process, with the new config.

    Refuses a parent that is still running: its process is alive (the store marks runs of dead
    processes ``killed`` whenever it is read), and two writers would run the same episodes.
    """
    store.reopen_run(run_id, config)


def episode_outcome(sim: SimulationRun) -> dict[str, Any]:
    """What ``runs show`` prints and what a resume or an export reads back."""
    reward = sim.reward_info.reward if sim.reward_info is not None else None
    out: dict[str, Any] = {"task_id": sim.task_id, "trial": sim.trial, "seed": sim.seed, "reward": reward,
                           "termination_reason": sim.termination_reason.value,
                           "simulation": sim.model_dump(mode="json")}
    if reward is not None:
        out["rewards"] = {"reward": float(reward)}  # the trainers' view (RunRecord.to_trajectory)
    return out


def record_episode(store: RunStore, parent_id: str, sim: SimulationRun, *, eval_name: str, graph: str | None,
                   model_spec: str | None) -> str:
    """Write a finished episode as one child run, all in one transaction; returns its run id (the
    simulation id). Blocking (20-130 ms): call it from a thread."""
    failed = needs_rerun(sim)
    config = {"eval": eval_name, "domain": sim.domain, "task_id": sim.task_id, "trial": sim.trial, "seed": sim.seed}
    trajectory = Trajectory(id=sim.id, messages=list(sim.messages), turns=list(sim.agent_turns),
                            metadata={"eval": eval_name, "termination_reason": sim.termination_reason.value})
    return store.record_trajectory(trajectory, kind=EPISODE_KIND, status="failed" if failed else "completed",
                                   graph=graph, model_spec=model_spec, config=config,
                                   tags=[f"task:{sim.task_id}", f"trial:{sim.trial}"], outcome=episode_outcome(sim),
                                   parent_id=parent_id, started_at=_naive_utc(sim.start_time),
                                   error=sim.error if (failed or sim.error) else None)


def _naive_utc(iso: str) -> datetime | None:
    """The store keeps naive UTC timestamps."""
    try:
        ts = datetime.fromisoformat(iso)
    except (TypeError, ValueError):
        return None
    return ts.astimezone(timezone.utc).replace(tzinfo=None) if ts.tzinfo else ts


def load_episodes(store: RunStore, parent_id: str) -> list[EpisodeRecord]:
    """Every episode stored under the eval, oldest first."""
    out = []
    for run in store.list_runs(limit=None, parent_id=parent_id, kind=EPISODE_KIND):
        sim_json = (run.outcome or {}).get("simulation")
        if sim_json is None:
            continue
        out.append(EpisodeRecord(run.id, run.status, run.started_at, SimulationRun.model_validate(sim_json)))
    out.sort(key=lambda r: (r.started_at, r.simulation.end_time))
    return out


def latest_episodes(records: list[EpisodeRecord]) -> list[EpisodeRecord]:
    """One record per (task, trial): the latest good one, else the latest failed one."""
    best: dict[tuple[str, int | None], EpisodeRecord] = {}
    for rec in records:  # oldest first, so a later record replaces an earlier one of the same kind
        prev = best.get(rec.key)
        if prev is None or needs_rerun(prev.simulation) or not needs_rerun(rec.simulation):
            best[rec.key] = rec
    return list(best.values())
