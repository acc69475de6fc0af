"""The state of an agent graph. Lists grow by concatenation (``operator.add``), so a node returns
only what it adds; nothing is ever rewritten in place, which keeps the token record exact."""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

from pydantic import BaseModel

from closedloop.messages import Message, Turn


class ToolRecord(BaseModel):
    """One executed tool call, for the run store and for graders."""

    call_id: str
    name: str
    arguments: str
    content: str
    error: str | None = None
    error_kind: str | None = None
    latency_s: float = 0.0
    turn_idx: int | None = None  # which model turn issued the call


class AgentState(TypedDict, total=False):
    messages: Annotated[list[Message], operator.add]
    turns: Annotated[list[Turn], operator.add]
    tool_records: Annotated[list[ToolRecord], operator.add]
    # Free-form per-graph data (beliefs, stage, ...) that specialised graphs extend.
    scratch: dict[str, Any]
