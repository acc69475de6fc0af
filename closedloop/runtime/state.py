"""The state of an agent graph. Lists grow by concatenation, so a node returns only what it adds;
nothing is ever rewritten in place, which keeps the token record exact.

``messages`` takes our messages, LangChain messages or OpenAI-format dicts and keeps the thread in
the form it started in (:func:`~closedloop.runtime.convert.merge_messages`); ``turns`` and
``tool_records`` are always ours: they are the training and audit record.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict, Union

from langchain_core.messages import AnyMessage
from pydantic import BaseModel

from closedloop.messages import AssistantMessage, SystemMessage, ToolMessage, Turn, UserMessage
from closedloop.runtime.convert import merge_messages


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


#: A message in any accepted form (ours, LangChain's, an OpenAI-format dict).
AnyFormMessage = Union[SystemMessage, UserMessage, AssistantMessage, ToolMessage, AnyMessage, dict[str, Any]]


class AgentState(TypedDict, total=False):
    messages: Annotated[list[AnyFormMessage], merge_messages]
    turns: Annotated[list[Turn], operator.add]
    tool_records: Annotated[list[ToolRecord], operator.add]
    # Free-form per-graph data (beliefs, stage, ...) that specialised graphs extend.
    scratch: dict[str, Any]
