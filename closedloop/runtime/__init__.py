"""The graph runtime: agent graphs are plain LangGraph ``StateGraph``s built from these parts.

- :mod:`.state`: the state every agent graph carries (messages, token-exact turns, tool records).
- :mod:`.nodes`: the model node (our client, recording turns) and the tool node (our registry,
  with optional human approval through ``interrupt``).
- :mod:`.checkpoint`: LangGraph savers (in-memory, SQLite) that can read our types back.
- :mod:`.execute`: run a compiled graph once, streaming tokens and recording into the run store.
"""

from closedloop.runtime.checkpoint import make_checkpointer, register_state_types, serializer
from closedloop.runtime.nodes import make_model_node, make_tool_node, route_after_model, wire_tool_loop
from closedloop.runtime.state import AgentState, ToolRecord

register_state_types()  # our types revive in every checkpointer, not only the ones we configure

__all__ = ["AgentState", "ToolRecord", "make_model_node", "make_tool_node", "route_after_model", "wire_tool_loop",
           "make_checkpointer", "register_state_types", "serializer"]
