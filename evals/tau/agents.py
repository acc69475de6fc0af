"""Agents for τ-bench episodes: any registered LangGraph graph, or the gold-replay oracle.

A graph plays the agent as a one-step policy (``execute_tools=False``): the orchestrator owns the
environment and executes tool calls, as in tau2. Each episode gets its own thread in an in-memory
checkpointer, so graph state that is not in the messages (the clarifier's question budget and
belief) persists across the episode's turns; only the messages the graph has not yet seen are
sent on each call.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

from closedloop import plugins
from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.oracle import OracleAgent
from closedloop.evals.tau.orchestrator import AgentFn
from closedloop.messages import AssistantMessage, Turn, _Message
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.runtime import make_checkpointer
from closedloop.tool import Tool, ToolRegistry

AgentFactory = Callable[[Task], AgentFn]


def graph_agent(factory: Callable[..., Any], client: ModelClient, *, params: SamplingParams | None = None,
                **options: Any) -> AgentFn:
    """Wrap a graph factory (``build_react_graph``-shaped) as a τ-bench agent for one episode."""
    state: dict[str, Any] = {"graph": None, "seen": 0}
    config = {"configurable": {"thread_id": uuid.uuid4().hex}}

    async def agent(messages: list[_Message], tools: list[Tool]) -> Turn | AssistantMessage:
        if state["graph"] is None:
            registry = ToolRegistry().extend(list(tools))
            # The policy arrives as the episode's system message; the graph must not add its own.
            state["graph"] = factory(client, registry, system_prompt=None, params=params, execute_tools=False,
                                     checkpointer=make_checkpointer("memory"), **options)
        new = messages[state["seen"]:]
        out = await state["graph"].ainvoke({"messages": new}, config)
        state["seen"] = len(messages) + 1  # the orchestrator appends our reply to its history
        last = out["messages"][-1]
        turns = out.get("turns") or []
        if turns and turns[-1].message == last:
            return turns[-1]
        return last if isinstance(last, AssistantMessage) else AssistantMessage(content=str(last))

    return agent


def make_agent_factory(name: str, client: ModelClient | None = None, *, params: SamplingParams | None = None,
                       **options: Any) -> AgentFactory:
    """``oracle`` (no model) or any graph registered under ``closedloop.graphs``."""
    if name == "oracle":
        return OracleAgent
    if client is None:
        raise ValueError(f"agent {name!r} needs a model (--model)")
    factory = plugins.load("closedloop.graphs", name)
    return lambda task: graph_agent(factory, client, params=params, **options)
