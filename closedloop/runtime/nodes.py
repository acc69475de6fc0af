"""The two nodes every tool-calling agent graph is made of, as plain async functions of state.

Both are built by factories that close over their collaborators (a model client, a tool
registry), so the graph stays data and each node can be tested as dict in, dict out.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Collection, Optional

from langchain_core.runnables import RunnableConfig
from langgraph.config import get_stream_writer
from langgraph.graph import END
from langgraph.types import interrupt

from closedloop.messages import AssistantMessage, SystemMessage, ToolCall, Turn
from closedloop.models.base import ModelClient, SamplingParams, TextDelta, TurnDone
from closedloop.runtime.state import AgentState, ToolRecord
from closedloop.tool import ToolRegistry, ToolResult


#: ``config["configurable"][SAMPLING_SEED]`` of a graph run: the sample seed of this run's model calls.
SAMPLING_SEED = "sampling_seed"


def run_params(params: SamplingParams | None, config: Optional[RunnableConfig]) -> SamplingParams | None:
    """The sampling parameters of one model call in a graph run: ``params`` with the run's seed.

    A run can carry a seed in ``config["configurable"]["sampling_seed"]`` (an int); it replaces
    the seed of ``params`` for that run only. This is how one compiled graph serves many seeded
    episodes (a trainer's rollout batch invokes it once per episode with that episode's seed), so a
    run samples exactly as a graph built with ``params.seed = sampling_seed`` would. Without it,
    ``params`` are used as given. Nodes other than the model node that call the model (e.g. the
    clarifier's question) use this too, so every sampled turn of a run follows its seed.
    """
    seed = ((config or {}).get("configurable") or {}).get(SAMPLING_SEED)
    if seed is None:
        return params
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"configurable[{SAMPLING_SEED!r}] must be an int, got {type(seed).__name__}")
    return (params or SamplingParams()).model_copy(update={"seed": seed})


def make_model_node(client: ModelClient, tools: ToolRegistry | None = None, *, system_prompt: str | None = None,
                    params: SamplingParams | None = None, stream_tokens: bool = False) -> Callable[[AgentState], Any]:
    """A node that calls the model on the conversation so far and appends the turn.

    The system prompt is prepended at call time when the conversation has none, so the state
    keeps only what happened. With ``stream_tokens`` text deltas go to LangGraph's ``custom``
    stream as ``{"token": text}`` while the node still returns the complete, token-exact turn.
    """
    schemas = tools.schemas if tools and len(tools) else None

    async def model_node(state: AgentState, config: Optional[RunnableConfig] = None) -> dict[str, Any]:
        call_params = run_params(params, config)
        messages = list(state.get("messages", []))
        if system_prompt and not (messages and messages[0].role == "system"):
            messages.insert(0, SystemMessage(content=system_prompt))
        if stream_tokens:
            writer = get_stream_writer()
            turn: Turn | None = None
            async for event in client.stream(messages, schemas, call_params):
                if isinstance(event, TextDelta):
                    writer({"token": event.text})
                elif isinstance(event, TurnDone):
                    turn = event.turn
            if turn is None:
                raise RuntimeError(f"{client.spec}: stream ended without a final turn")
        else:
            turn = await client.generate(messages, schemas, call_params)
        return {"messages": [turn.message], "turns": [turn]}

    return model_node


Approval = Callable[[str], bool]


def _needs_approval(approve: bool | Collection[str]) -> Approval:
    if isinstance(approve, bool):
        return lambda name: approve
    names = set(approve)
    return lambda name: name in names


def _decision(value: Any) -> tuple[bool, str | None]:
    """Resume values: True/False, "approve"/"reject", or {"approve": bool, "reason": str}."""
    if isinstance(value, dict):
        return bool(value.get("approve")), value.get("reason")
    if isinstance(value, str):
        return value.strip().lower() in {"approve", "approved", "yes", "y"}, None
    return bool(value), None


def make_tool_node(tools: ToolRegistry, *, approve: bool | Collection[str] = False) -> Callable[[AgentState], Any]:
    """A node that executes the last assistant message's tool calls concurrently.

    Calls that need approval pause the graph with ``interrupt`` *before* any tool runs: LangGraph
    re-runs a node from its first line on resume, so side effects must come after every interrupt.
    A rejected call returns a tool message saying so, and the model carries on.
    """
    needs_approval = _needs_approval(approve)

    async def tool_node(state: AgentState) -> dict[str, Any]:
        messages = state.get("messages", [])
        last = messages[-1] if messages else None
        if not isinstance(last, AssistantMessage) or not last.tool_calls:
            return {}
        calls: list[ToolCall] = last.tool_calls
        decisions = []
        for call in calls:
            if needs_approval(call.name):
                decisions.append(_decision(interrupt({"type": "tool_approval", "tool_call_id": call.id,
                                                      "name": call.name, "arguments": call.function.arguments})))
            else:
                decisions.append((True, None))

        async def run(call: ToolCall, decision: tuple[bool, str | None]) -> ToolResult:
            approved, reason = decision
            if approved:
                return await tools.call(call)
            msg = f"the user rejected this call to {call.name}" + (f": {reason}" if reason else "")
            return ToolResult(call.name, f"Error: {msg}", msg, "rejected")

        results = await asyncio.gather(*(run(c, d) for c, d in zip(calls, decisions)))
        turn_idx = len(state.get("turns", [])) - 1
        return {
            "messages": [r.to_message(c.id) for c, r in zip(calls, results)],
            "tool_records": [ToolRecord(call_id=c.id, name=c.name, arguments=c.function.arguments, content=r.content,
                                        error=r.error, error_kind=r.error_kind, latency_s=r.latency_s, turn_idx=turn_idx)
                             for c, r in zip(calls, results)],
        }

    return tool_node


def route_after_model(max_turns: int | None = None) -> Callable[[AgentState], str]:
    """Go to the tools when the model asked for some, else end; also end after ``max_turns``."""

    def route(state: AgentState) -> str:
        messages = state.get("messages", [])
        last = messages[-1] if messages else None
        if not isinstance(last, AssistantMessage) or not last.tool_calls:
            return END
        # Only the policy's own turns count: helper calls (trainable=False, e.g. the clarifier's
        # goal proposal) must not use up the agent's budget.
        if max_turns is not None and sum(1 for t in state.get("turns", []) if t.trainable) >= max_turns:
            return END
        return "tools"

    return route


def wire_tool_loop(graph: Any, tools: ToolRegistry, *, approve: bool | Collection[str] = False,
                   max_turns: int | None = None, execute_tools: bool = True, model: str = "model") -> None:
    """Wire ``model ⇄ tools`` into a ``StateGraph`` that already has the ``model`` node.

    With ``execute_tools=False`` the graph ends after each model turn instead (a one-step policy
    whose tool calls an outside environment executes).
    """
    if execute_tools:
        graph.add_node("tools", make_tool_node(tools, approve=approve))
        graph.add_conditional_edges(model, route_after_model(max_turns), {"tools": "tools", END: END})
        graph.add_edge("tools", model)
    else:
        graph.add_edge(model, END)


__all__ = ["SAMPLING_SEED", "make_model_node", "run_params", "make_tool_node", "route_after_model", "wire_tool_loop"]
