"""The state of an agent graph. Lists grow by their reducers, so a node returns only what it adds;
nothing is rewritten in place, which keeps the token record exact.

``messages`` is the conversation in LangChain's form whatever form a caller sends
(:func:`~closedloop.runtime.convert.add_any_messages`; why LangChain's: see
:mod:`closedloop.runtime.convert`); ``turns`` and ``tool_records`` are ours: they are the
training and audit record. ``scratch`` is the graph's own data (beliefs, stage, budgets): what a
graph must remember between the steps of an environment lives there, since an environment that
drives the graph step by step hands it back on the next step (:mod:`closedloop.trainers.rollout`,
:mod:`closedloop.evals.tau.agents`).
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AnyMessage
from pydantic import BaseModel

from closedloop.messages import Turn
from closedloop.runtime.convert import add_any_messages


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
    messages: Annotated[list[AnyMessage], add_any_messages]
    turns: Annotated[list[Turn], operator.add]
    tool_records: Annotated[list[ToolRecord], operator.add]
    scratch: dict[str, Any]


class MessagesOnly(TypedDict, total=False):
    """What the tool loop's routers read (their input schema). LangGraph gives a router the state
    with the step's writes applied to a copy of every channel of its input schema; declaring only
    ``messages`` spares the copies of the other channels (``turns``, ``tool_records``, ...) at
    every step. The channel is declared exactly as :class:`AgentState` declares it."""

    messages: Annotated[list[AnyMessage], add_any_messages]
