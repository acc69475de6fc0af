"""``react``: the reference tool-calling agent graph (model ⇄ tools until the model answers).

Later agents reuse it by passing their own system prompt, tools and sampling, or by adding nodes
around the same model and tool nodes.

    START → model ──(tool calls?)──→ tools → model …
                  └──(no calls / max_turns)──→ END
"""

from __future__ import annotations

from typing import Any, Collection

from langgraph.graph import START, StateGraph

from closedloop.models.base import ModelClient, SamplingParams
from closedloop.runtime import AgentState, make_model_node, wire_tool_loop
from closedloop.tool import ToolRegistry

DEFAULT_SYSTEM_PROMPT = ("You are a helpful assistant. Use the tools when they help; "
                         "answer the user directly when you have what you need.")


def build_react_graph(client: ModelClient, tools: ToolRegistry | None = None, *,
                      system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, params: SamplingParams | None = None,
                      max_turns: int = 8, approve: bool | Collection[str] = False,
                      stream_tokens: bool = False, execute_tools: bool = True, checkpointer: Any = None):
    """Compile the react graph. ``approve`` pauses before the named (or all) tool calls.

    ``execute_tools=False`` makes it a one-step policy: it ends after each model turn and leaves
    the tool calls to an environment that executes them (the τ-bench orchestrator, a gym).
    """
    tools = tools or ToolRegistry()
    graph = StateGraph(AgentState)
    graph.add_node("model", make_model_node(client, tools, system_prompt=system_prompt, params=params,
                                            stream_tokens=stream_tokens))
    graph.add_edge(START, "model")
    wire_tool_loop(graph, tools, approve=approve, max_turns=max_turns, execute_tools=execute_tools)
    return graph.compile(checkpointer=checkpointer, name="react")


def make_graph(config: Any = None):
    """The ``langgraph.json`` entry: the react graph with the model and tools of the run's config
    (``configurable``/``context`` keys ``model``, ``tools``, ``approve``, ...; see
    :data:`closedloop.runtime.factory.CONFIG_KEYS`)."""
    from closedloop.runtime.factory import served_graph

    return served_graph(build_react_graph, config)
