"""The nodes every tool-calling agent graph is made of: module-level functions of (state, runtime).

The model, tools and settings come from the run's context (``runtime.context``, an
:class:`~closedloop.runtime.context.AgentContext`), so a node is plain data in a compiled graph and
is tested as dict in, dict out. The messages channel is LangChain's; nodes read it in our typed
form (:func:`~closedloop.runtime.convert.as_closedloop`) and write LangChain messages back.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableConfig
from langgraph.config import get_config
from langgraph.graph import END, StateGraph
from langgraph.runtime import Runtime
from langgraph.types import StreamWriter, interrupt

from closedloop.messages import AssistantMessage, SystemMessage, ToolCall, Turn
from closedloop.models.base import ModelClient, SamplingParams, TextDelta, TurnDone
from closedloop.runtime.approval import Decision, approval_request, parse_decisions
from closedloop.runtime.context import AgentContext, context_of
from closedloop.runtime.convert import ai_message, as_closedloop, role_of, to_closedloop, to_langchain
from closedloop.runtime.state import AgentState, MessagesOnly, ToolRecord
from closedloop.runtime.stream import has_callbacks, stream_turn_with_callbacks
from closedloop.tool import ToolRegistry, ToolResult


async def call_model(client: ModelClient, messages: Sequence[Any], *, tools: list[dict[str, Any]] | None = None,
                     params: SamplingParams | None = None, system_prompt: str | None = None,
                     stream_tokens: bool = False, config: RunnableConfig | None = None,
                     writer: StreamWriter | None = None) -> tuple[Turn, AIMessage]:
    """One model call on a conversation (any form): the token-exact turn and its ``AIMessage``.

    ``system_prompt`` is prepended when the conversation has none (the state keeps only what
    happened). With ``stream_tokens`` every text delta goes to ``writer`` (LangGraph's ``custom``
    stream) as ``{"token": text}``. When the run has callbacks (``stream_mode="messages"``, a
    tracer), the call is reported to them as a chat-model run (:mod:`closedloop.runtime.stream`);
    ``config`` defaults to the config of the graph run this is called from.
    """
    if config is None:
        config = _run_config()
    ours = as_closedloop(messages)
    if system_prompt and not (ours and isinstance(ours[0], SystemMessage)):
        ours.insert(0, SystemMessage(content=system_prompt))
    emit = (lambda text: writer({"token": text})) if stream_tokens and writer is not None else None
    if has_callbacks(config):
        return await stream_turn_with_callbacks(client, ours, tools, params, config, emit)
    if emit is None:
        turn = await client.generate(ours, tools, params)
        return turn, ai_message(turn.message, turn)
    done = None
    async for event in client.stream(ours, tools, params):
        if isinstance(event, TextDelta):
            emit(event.text)
        elif isinstance(event, TurnDone):
            done = event.turn
    if done is None:
        raise RuntimeError(f"{client.spec}: stream ended without a final turn")
    return done, ai_message(done.message, done)


def _run_config() -> RunnableConfig | None:
    try:
        return get_config()
    except RuntimeError:  # not inside a graph run
        return None


async def model_node(state: AgentState, runtime: Runtime[Any]) -> dict[str, Any]:
    """Call the policy on the conversation so far and append its turn (message and token record)."""
    ctx = context_of(runtime, AgentContext)
    turn, message = await call_model(ctx.model_client(), state.get("messages", []), tools=ctx.offered_tools(),
                                     params=ctx.params, system_prompt=ctx.system_prompt,
                                     stream_tokens=ctx.stream_tokens, writer=runtime.stream_writer)
    return {"messages": [message], "turns": [turn]}


async def run_tool_calls(state: AgentState, tools: ToolRegistry,
                         needs_approval: Callable[[str], bool] = lambda name: False) -> dict[str, Any]:
    """Execute the last assistant message's tool calls concurrently (the tool node's work).

    Calls that need approval pause the graph with one ``interrupt`` (LangChain's HITL request shape,
    :func:`~closedloop.runtime.approval.approval_request`) *before* any tool runs: LangGraph
    re-runs a node from its first line on resume, so side effects must come after every interrupt.
    A rejected call returns a tool message saying so, and the model carries on; an edited call
    runs with the reviewer's arguments (the model's own call stays in the record as it was
    generated, and the tool message says what was changed).
    """
    raw = state.get("messages", [])
    last = to_closedloop(raw[-1]) if raw else None
    if not isinstance(last, AssistantMessage) or not last.tool_calls:
        return {}
    calls: list[ToolCall] = last.tool_calls
    pending = [c for c in calls if needs_approval(c.name)]
    decided: dict[str, Decision] = {}
    if pending:
        for call, d in zip(pending, parse_decisions(interrupt(approval_request(pending)), pending)):
            decided[call.id] = d

    async def run(call: ToolCall) -> tuple[ToolCall, ToolResult]:
        kind, detail = decided.get(call.id, ("approve", None))
        if kind == "reject":
            msg = f"the user rejected this call to {call.name}" + (f": {detail}" if detail else "")
            return call, ToolResult(call.name, f"Error: {msg}", msg, "rejected")
        if kind == "edit":
            edited: ToolCall = detail
            result = await tools.call(edited)
            note = f"[the user edited this call to {edited.name}({edited.function.arguments})] "
            result.content = note + result.content
            return edited, result
        return call, await tools.call(call)

    # One call (the common case) is awaited as it is: gather would wrap it in a task for nothing.
    done = [await run(calls[0])] if len(calls) == 1 else await asyncio.gather(*(run(c) for c in calls))
    turn_idx = len(state.get("turns", [])) - 1
    return {
        "messages": [to_langchain(r.to_message(c.id)) for c, r in done],
        "tool_records": [ToolRecord(call_id=c.id, name=c.name, arguments=c.function.arguments, content=r.content,
                                    error=r.error, error_kind=r.error_kind, latency_s=r.latency_s, turn_idx=turn_idx)
                         for c, r in done],
    }


async def tool_node(state: AgentState, runtime: Runtime[Any]) -> dict[str, Any]:
    """Run the model's tool calls with the context's tools, pausing for the approvals it asks for."""
    ctx = context_of(runtime, AgentContext)
    return await run_tool_calls(state, ctx.tools, ctx.needs_approval)


def model_calls_this_invocation(messages: Sequence[Any]) -> int:
    """Assistant messages since the last user message: the model calls of the current invocation."""
    n = 0
    for m in reversed(messages):
        role = role_of(m)
        if role == "user":
            break
        if role == "assistant":
            n += 1
    return n


def asked_for_tools(messages: Sequence[Any]) -> bool:
    """Whether the last message is an assistant message with tool calls (malformed ones included)."""
    last = messages[-1] if messages else None
    if last is None or role_of(last) != "assistant":
        return False
    if isinstance(last, AIMessage):
        return bool(last.tool_calls or last.invalid_tool_calls)
    return bool(to_closedloop(last).tool_calls)  # type: ignore[attr-defined]


async def route_after_model(state: MessagesOnly, runtime: Runtime[Any]) -> str:
    """To the tools when the model asked for some and the graph runs them; else end.

    The turn budget is applied after the tools ran (:func:`route_after_tools`), so every tool call
    in the thread has its result and the next invocation starts from a valid conversation.
    """
    if not context_of(runtime, AgentContext).execute_tools:
        return END
    return "tools" if asked_for_tools(state.get("messages", [])) else END


async def route_after_tools(state: MessagesOnly, runtime: Runtime[Any]) -> str:
    """Back to the model, unless this invocation already made ``max_turns`` model calls.

    The budget is per invocation (model calls since the last user message), so a thread can go on
    indefinitely: each new user message starts a fresh budget. Only messages count, so helper
    calls that add no message (e.g. the clarifier's goal proposal) do not use it up.
    """
    budget = context_of(runtime, AgentContext).max_turns
    return END if model_calls_this_invocation(state.get("messages", [])) >= budget else "model"


def add_tool_loop(builder: StateGraph[Any, Any, Any, Any]) -> None:
    """Wire ``model ⇄ tools`` into a graph builder that already has the ``model`` node: tool calls
    go to the tools and back while the turn budget lasts; with ``execute_tools=False`` in the run
    context the graph ends after each model turn (an environment runs the calls)."""
    builder.add_node("tools", tool_node)
    builder.add_conditional_edges("model", route_after_model, {"tools": "tools", END: END})
    builder.add_conditional_edges("tools", route_after_tools, {"model": "model", END: END})


__all__ = ["call_model", "model_node", "tool_node", "run_tool_calls", "route_after_model", "route_after_tools",
           "model_calls_this_invocation", "asked_for_tools", "add_tool_loop"]
