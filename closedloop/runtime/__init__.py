"""The graph runtime: agent graphs are plain LangGraph ``StateGraph``s built from these parts.

- :mod:`.context`: the run context (model, tools, settings) every graph takes as LangGraph's
  ``context``; :mod:`.contract`: what a graph is and how callers load and run one.
- :mod:`.state`: the state every agent graph carries (messages, token-exact turns, tool records).
- :mod:`.nodes`: the model node (our client, recording turns) and the tool node (the context's
  tools, with optional human approval through ``interrupt``, :mod:`.approval`).
- :mod:`.convert`: our messages and LangChain's (the channel's form); :mod:`.stream`: a model call
  reported to LangChain callbacks.
- :mod:`.checkpoint`: LangGraph savers (in-memory, SQLite) that can read our types back.
- :mod:`.execute`: run a compiled graph once, streaming tokens and recording into the run store.
"""

from closedloop.runtime.checkpoint import make_checkpointer, register_state_types, serializer
from closedloop.runtime.context import AgentContext
from closedloop.runtime.contract import check_graph, context_for, load_graph, with_checkpointer
from closedloop.runtime.nodes import add_tool_loop, model_node, tool_node
from closedloop.runtime.state import AgentState, ToolRecord

register_state_types()  # our types revive in every checkpointer, not only the ones we configure

__all__ = ["AgentContext", "AgentState", "ToolRecord", "model_node", "tool_node", "add_tool_loop", "check_graph",
           "context_for", "load_graph", "with_checkpointer", "make_checkpointer", "register_state_types",
           "serializer"]
