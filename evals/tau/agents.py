"""Agents for τ-bench episodes: any registered LangGraph graph, or the gold-replay oracle.

A graph plays the agent as a one-step policy (``execute_tools=False``): the orchestrator owns the
environment and executes tool calls, as in tau2. Each call runs the graph on the agent's whole
view of the conversation (what tau2's agent sees: the policy as the system message, then the
messages so far), with the episode's run context (model, the environment's tools, sampling). The
agent's state between calls is explicit, as in tau2 (``get_init_state`` /
``generate_next_message(message, state)``): the graph's ``scratch`` (the clarifier's question
budget and belief), handed back on the next call. No checkpointer thread, so nothing to keep in
step with the orchestrator's history.
"""

from __future__ import annotations

from typing import Any, Callable

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.oracle import OracleAgent
from closedloop.evals.tau.orchestrator import AgentFn
from closedloop.messages import AssistantMessage, Turn, _Message
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.runtime import AgentContext, context_for, load_graph
from closedloop.runtime.convert import action_of
from closedloop.tool import Tool, ToolRegistry

AgentFactory = Callable[[Task], AgentFn]


def graph_agent(graph: Any, context: AgentContext) -> AgentFn:
    """A τ-bench agent for one episode: ``graph`` (a compiled closedloop graph) acting with
    ``context`` (its ``tools`` are set from the environment's on the first call)."""
    state: dict[str, Any] = {"scratch": {}, "context": None}

    async def agent(messages: list[_Message], tools: list[Tool]) -> Turn | AssistantMessage:
        if state["context"] is None:
            state["context"] = context.model_copy(update={"tools": ToolRegistry().extend(list(tools))})
        out = await graph.ainvoke({"messages": messages, "scratch": state["scratch"]}, context=state["context"])
        state["scratch"] = out.get("scratch") or {}
        return action_of(out["messages"][-1])

    return agent


def make_agent_factory(name: str, client: ModelClient | None = None, *, params: SamplingParams | None = None,
                       **options: Any) -> AgentFactory:
    """``oracle`` (no model) or any graph registered under ``closedloop.graphs``; ``options`` are
    fields of the graph's run context (e.g. the clarifier's ``threshold``)."""
    if name == "oracle":
        return OracleAgent
    if client is None:
        raise ValueError(f"agent {name!r} needs a model (--model)")
    graph = load_graph(name)
    # The policy arrives as the episode's system message: the graph adds no prompt of its own.
    context = context_for(graph, client=client, params=params, system_prompt=None, execute_tools=False, **options)
    return lambda task: graph_agent(graph, context)
