"""Typed records the store returns; rows never leak out as tuples."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, Field

from closedloop.messages import Message, Trajectory, Turn

__all__ = ["RunStatus", "TERMINAL_STATUSES", "RunSummary", "RunRecord", "ToolCallRecord", "utcnow", "reward_dict",
           "trajectory_metadata"]

# "waiting": the run stopped on an approval nobody could answer; its thread resumes it (closedloop run --thread).
RunStatus = Literal["running", "completed", "failed", "killed", "interrupted", "waiting"]
TERMINAL_STATUSES = ("completed", "failed", "killed", "interrupted", "waiting")


def utcnow() -> datetime:
    """Naive UTC: DuckDB's TIMESTAMP has no zone, and TIMESTAMPTZ would follow the session's zone."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def reward_dict(run_id: str, rewards: Any) -> dict[str, float]:
    """``outcome["rewards"]`` as named floats (empty when the run has none)."""
    if not rewards:
        return {}
    if not isinstance(rewards, dict):
        raise ValueError(f"run {run_id}: outcome.rewards must be a mapping of name -> float")
    return {str(k): float(v) for k, v in rewards.items()}


def trajectory_metadata(*, run_id: str, kind: str, graph: str | None, model_spec: str | None, status: str,
                        tags: list[str], parent_id: str | None, metadata: dict[str, Any],
                        config_task_id: Any = None, outcome_task_id: Any = None) -> dict[str, Any]:
    """What a trajectory read back from the store carries in ``metadata``.

    The run's own fields (``run_id``, ``kind``, ``graph``, ``model_spec``, ``status``, ``tags``,
    ``parent_id``), then the metadata it was recorded with (which wins on a clash, as it always
    has). ``task_id`` identifies the task for preference pairs and GRPO groups: the recorded
    ``metadata["task_id"]``, else the run config's ``task_id`` (τ-bench episodes), else the
    outcome's, else a ``task:<id>`` tag; absent when none is known.
    """
    out: dict[str, Any] = {"run_id": run_id, "kind": kind, "graph": graph, "model_spec": model_spec, "status": status,
                           "tags": list(tags), "parent_id": parent_id, **metadata}
    if out.get("task_id") is None:
        task = config_task_id if config_task_id is not None else outcome_task_id
        if task is None:
            task = next((t[len("task:"):] for t in tags if t.startswith("task:")), None)
        if task is not None:
            out["task_id"] = task
    return out


class RunSummary(BaseModel):
    """One row of ``runs``: what ``list_runs`` returns. Times are naive UTC."""

    id: str
    kind: str
    graph: str | None = None
    model_spec: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    status: RunStatus
    pid: int | None = None
    hostname: str | None = None
    parent_id: str | None = None
    closedloop_version: str | None = None
    started_at: datetime
    updated_at: datetime
    ended_at: datetime | None = None
    outcome: dict[str, Any] | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    tags: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    # A credential was redacted from the run's messages or turns; turns from that point on keep no
    # token ids (Turn.unavailable says so), since the ids would decode back to it.
    secrets_redacted: bool = False

    @property
    def duration_s(self) -> float | None:
        return None if self.ended_at is None else (self.ended_at - self.started_at).total_seconds()


class ToolCallRecord(BaseModel):
    idx: int
    turn_idx: int | None = None
    call_id: str | None = None
    name: str
    arguments: str | None = None
    result: str | None = None
    error: str | None = None
    error_kind: str | None = None
    latency_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class RunRecord(RunSummary):
    """A run with everything logged under it, in logging order."""

    messages: list[Message] = Field(default_factory=list)
    turns: list[Turn] = Field(default_factory=list)
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)

    def to_trajectory(self) -> Trajectory:
        """The run as a trainer sees it: rewards and step rewards come from ``outcome``; ``metadata``
        is :func:`trajectory_metadata` (run id, kind, graph, parent, task id, recorded metadata)."""
        outcome = self.outcome or {}
        return Trajectory(id=self.id, messages=list(self.messages), turns=list(self.turns),
                          rewards=reward_dict(self.id, outcome.get("rewards")),
                          step_rewards=list(outcome.get("step_rewards") or []),
                          metadata=trajectory_metadata(run_id=self.id, kind=self.kind, graph=self.graph,
                                                       model_spec=self.model_spec, status=self.status,
                                                       tags=self.tags, parent_id=self.parent_id,
                                                       metadata=self.metadata,
                                                       config_task_id=self.config.get("task_id"),
                                                       outcome_task_id=outcome.get("task_id")))
