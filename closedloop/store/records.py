"""Typed records the store returns; rows never leak out as tuples."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, Field

from closedloop.messages import Message, Trajectory, Turn

__all__ = ["RunStatus", "TERMINAL_STATUSES", "RunSummary", "RunRecord", "ToolCallRecord", "utcnow"]

RunStatus = Literal["running", "completed", "failed", "killed", "interrupted"]
TERMINAL_STATUSES = ("completed", "failed", "killed", "interrupted")


def utcnow() -> datetime:
    """Naive UTC: DuckDB's TIMESTAMP has no zone, and TIMESTAMPTZ would follow the session's zone."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


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
        """The run as a trainer sees it: rewards and step rewards come from ``outcome``."""
        outcome = self.outcome or {}
        rewards = outcome.get("rewards") or {}
        if not isinstance(rewards, dict):
            raise ValueError(f"run {self.id}: outcome.rewards must be a mapping of name -> float")
        return Trajectory(id=self.id, messages=list(self.messages), turns=list(self.turns),
                          rewards={str(k): float(v) for k, v in rewards.items()},
                          step_rewards=list(outcome.get("step_rewards") or []),
                          metadata={"kind": self.kind, "graph": self.graph, "model_spec": self.model_spec,
                                    "status": self.status, "tags": list(self.tags), **self.metadata})
