"""``react``: the reference tool-calling agent graph (model ⇄ tools until the model answers).

    START → model ──(tool calls?)──→ tools → model …
                  └──(no calls / max_turns / execute_tools=False)──→ END

The model, tools, sampling, approvals and budget come from the run context
(:class:`~closedloop.runtime.context.AgentContext`)::

    from closedloop.graphs.react import graph
    out = await graph.ainvoke({"messages": [("user", "3 + 4?")]},
                              context=AgentContext(client=client, tools=tool_registry(["arithmetic"])))

``execute_tools=False`` makes it a one-step policy: it ends after each model turn and leaves the
tool calls to an environment that executes them (the τ-bench orchestrator, a gym).
"""

from __future__ import annotations

from langgraph.graph import START, StateGraph

from closedloop.runtime.context import DEFAULT_SYSTEM_PROMPT, AgentContext
from closedloop.runtime.nodes import add_tool_loop, model_node
from closedloop.runtime.state import AgentState

builder = StateGraph(AgentState, context_schema=AgentContext)
builder.add_node("model", model_node)
builder.add_edge(START, "model")
add_tool_loop(builder)

graph = builder.compile(name="react")

__all__ = ["graph", "builder", "DEFAULT_SYSTEM_PROMPT"]
