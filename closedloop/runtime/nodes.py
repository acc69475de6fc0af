"""The two nodes every tool-calling agent graph is made of, as plain async functions of state.

Both are built by factories that close over their collaborators (a model client, a tool
registry), so the graph stays data and each node can be tested as dict in, dict out.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Callable, Collection, Optional, Sequence

from langchain_core.runnables import RunnableConfig
from langchain_core.messages import AIMessage
from langgraph.config import get_stream_writer
from langgraph.graph import END
from langgraph.pregel._messages import StreamMessagesHandler
from langgraph.types import interrupt

from closedloop.messages import AssistantMessage, FunctionCall, SystemMessage, ToolCall, Turn, _Message
from closedloop.runtime.convert import as_closedloop, in_form, role_of, thread_form, to_closedloop, to_langchain
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


def _messages_stream_requested(config: Optional[RunnableConfig]) -> bool:
    """True when the caller streams with ``stream_mode="messages"`` (LangGraph then adds its handler)."""
    callbacks = (config or {}).get("callbacks")
    handlers = callbacks if isinstance(callbacks, list) else getattr(callbacks, "handlers", None)
    return any(isinstance(h, StreamMessagesHandler) for h in handlers or [])


class TextGate:
    """Which streamed text to show as message content: everything up to the first ``<`` (where
    tool-call or reasoning markup may start), the rest once the parsed message is known. A
    streamed prefix is therefore always a prefix of the final message text."""

    def __init__(self) -> None:
        self.sent = ""
        self.closed = False

    def feed(self, text: str) -> str:
        if self.closed:
            return ""
        cut = text.find("<")
        if cut >= 0:
            self.closed, text = True, text[:cut]
        self.sent += text
        return text

    def finish(self, final: str) -> str:
        return final[len(self.sent):] if final.startswith(self.sent) else ""


async def stream_turn_with_callbacks(client: ModelClient, messages: list[_Message], schemas: Any,
                                     params: SamplingParams | None, config: Optional[RunnableConfig],
                                     on_text: Callable[[str], None] | None = None) -> tuple[Turn, Any]:
    """One model call reported to LangChain callbacks as a chat-model run (token chunks, final
    ``AIMessage`` carrying the turn), which is what LangGraph's ``stream_mode="messages"`` listens to."""
    from langchain_core.callbacks.manager import AsyncCallbackManager
    from langchain_core.messages import AIMessageChunk
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, LLMResult

    config = config or {}
    manager = AsyncCallbackManager.configure(inheritable_callbacks=config.get("callbacks"),
                                             inheritable_tags=config.get("tags"),
                                             inheritable_metadata=config.get("metadata"))
    run_id = uuid.uuid4()
    [run] = await manager.on_chat_model_start({"name": "ClosedloopChatModel"}, [[to_langchain(m) for m in messages]],
                                              run_id=run_id, name="ClosedloopChatModel",
                                              invocation_params={"model": client.spec})
    message_id = f"lc_run--{run_id}"
    gate, turn = TextGate(), None
    try:
        async for event in client.stream(messages, schemas, params):
            if isinstance(event, TextDelta):
                if on_text:
                    on_text(event.text)
                text = gate.feed(event.text)
                if text:
                    await run.on_llm_new_token(text, chunk=ChatGenerationChunk(
                        message=AIMessageChunk(content=text, id=message_id)))
            elif isinstance(event, TurnDone):
                turn = event.turn
        if turn is None:
            raise RuntimeError(f"{client.spec}: stream ended without a final turn")
    except BaseException as e:
        await run.on_llm_error(e)
        raise
    rest = gate.finish(turn.message.text)
    if rest:
        await run.on_llm_new_token(rest, chunk=ChatGenerationChunk(message=AIMessageChunk(content=rest, id=message_id)))
    ai = to_langchain(turn.message, turn)
    ai.id = message_id
    await run.on_llm_end(LLMResult(generations=[[ChatGeneration(message=ai)]]))
    return turn, ai


def make_model_node(client: ModelClient, tools: ToolRegistry | None = None, *, system_prompt: str | None = None,
                    params: SamplingParams | None = None, stream_tokens: bool = False) -> Callable[[AgentState], Any]:
    """A node that calls the model on the conversation so far and appends the turn.

    The system prompt is prepended at call time when the conversation has none, so the state
    keeps only what happened. With ``stream_tokens`` text deltas go to LangGraph's ``custom``
    stream as ``{"token": text}`` while the node still returns the complete, token-exact turn.
    When the caller streams ``stream_mode="messages"``, the call is also reported as a chat-model
    run, so LangGraph clients see token chunks and the final ``AIMessage`` (turn in its metadata).
    The message is written back in the thread's form (ours, LangChain's or OpenAI dicts).
    """
    schemas = tools.schemas if tools and len(tools) else None

    async def model_node(state: AgentState, config: Optional[RunnableConfig] = None) -> dict[str, Any]:
        call_params = run_params(params, config)
        raw = state.get("messages", [])
        form = thread_form(raw)
        messages = as_closedloop(raw)
        if system_prompt and not (messages and messages[0].role == "system"):
            messages.insert(0, SystemMessage(content=system_prompt))
        lc_message = None
        if _messages_stream_requested(config):
            writer = get_stream_writer() if stream_tokens else None
            turn, lc_message = await stream_turn_with_callbacks(
                client, messages, schemas, call_params, config,
                (lambda text: writer({"token": text})) if writer else None)
        elif stream_tokens:
            writer = get_stream_writer()
            turn = None
            async for event in client.stream(messages, schemas, call_params):
                if isinstance(event, TextDelta):
                    writer({"token": event.text})
                elif isinstance(event, TurnDone):
                    turn = event.turn
            if turn is None:
                raise RuntimeError(f"{client.spec}: stream ended without a final turn")
        else:
            turn = await client.generate(messages, schemas, call_params)
        if form == "closedloop":
            out: Any = turn.message
        elif form == "langchain":
            out = lc_message if lc_message is not None else to_langchain(turn.message, turn)
        else:
            out = turn.message.to_openai()
        return {"messages": [out], "turns": [turn]}

    return model_node


Approval = Callable[[str], bool]


def _needs_approval(approve: bool | Collection[str]) -> Approval:
    if isinstance(approve, bool):
        return lambda name: approve
    names = set(approve)
    return lambda name: name in names


#: What a reviewer may decide about a pending tool call (LangChain's human-in-the-loop decisions).
DECISIONS = ["approve", "edit", "reject"]


def approval_request(calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The interrupt payload for calls awaiting review, in LangChain's ``HITLRequest`` shape
    (``action_requests`` + ``review_configs``), which LangGraph Studio and Agent Inbox render.
    ``args`` is the parsed argument object, or the raw string when the model's JSON is malformed;
    each request also names its ``tool_call_id``."""
    actions = []
    for call in calls:
        try:
            args: Any = call.parsed_arguments()
        except (ValueError, TypeError):
            args = call.function.arguments
        actions.append({"name": call.name, "args": args, "tool_call_id": call.id,
                        "description": f"Tool execution pending approval\n\nTool: {call.name}\nArgs: "
                                       f"{call.function.arguments}"})
    names = list(dict.fromkeys(c.name for c in calls))
    return {"action_requests": actions,
            "review_configs": [{"action_name": n, "allowed_decisions": list(DECISIONS)} for n in names]}


Decision = tuple[str, Any]  # ("approve", None) | ("reject", message | None) | ("edit", ToolCall)


def parse_decisions(value: Any, calls: Sequence[ToolCall]) -> list[Decision]:
    """Resume values: LangChain's ``{"decisions": [{"type": "approve"} | {"type": "reject", "message": ...}
    | {"type": "edit", "edited_action": {"name": ..., "args": {...}}}, ...]}``, one per pending call in
    order; or, for all pending calls at once, ``True``/``False``, ``"approve"``/``"reject"``,
    ``{"approve": bool, "reason": str}``. Anything else is a ``ValueError`` naming what was expected."""
    if isinstance(value, dict) and "decisions" in value:
        items = value["decisions"]
        if not isinstance(items, list) or len(items) != len(calls):
            raise ValueError(f"resume with one decision per pending tool call: {len(calls)} expected, got "
                             f"{len(items) if isinstance(items, list) else type(items).__name__}")
        out: list[Decision] = []
        for call, d in zip(calls, items):
            kind = d.get("type") if isinstance(d, dict) else None
            if kind == "approve":
                out.append(("approve", None))
            elif kind == "reject":
                out.append(("reject", d.get("message")))
            elif kind == "edit":
                action = d.get("edited_action") or {}
                args = action.get("args", {})
                out.append(("edit", ToolCall(id=call.id, function=FunctionCall(
                    name=action.get("name") or call.name,
                    arguments=args if isinstance(args, str) else json.dumps(args)))))
            else:
                raise ValueError(f"unknown decision {d!r}; use a dict with type one of {DECISIONS}")
        return out
    if isinstance(value, dict) and "approve" in value:
        one: Decision = ("approve", None) if value.get("approve") else ("reject", value.get("reason"))
    elif isinstance(value, str):
        one = ("approve", None) if value.strip().lower() in {"approve", "approved", "yes", "y"} else ("reject", None)
    elif isinstance(value, bool):
        one = ("approve", None) if value else ("reject", None)
    else:
        raise ValueError(f"cannot read a review decision from {value!r}; resume with "
                         "{'decisions': [{'type': 'approve'|'edit'|'reject', ...}]}")
    return [one] * len(calls)


def make_tool_node(tools: ToolRegistry, *, approve: bool | Collection[str] = False) -> Callable[[AgentState], Any]:
    """A node that executes the last assistant message's tool calls concurrently.

    Calls that need approval pause the graph with one ``interrupt`` (LangChain's HITL request shape,
    :func:`approval_request`) *before* any tool runs: LangGraph re-runs a node from its first line
    on resume, so side effects must come after every interrupt. A rejected call returns a tool
    message saying so, and the model carries on; an edited call runs with the reviewer's arguments
    (the model's own call stays in the record as it was generated, and the tool message says what
    was changed).
    """
    needs_approval = _needs_approval(approve)

    async def tool_node(state: AgentState) -> dict[str, Any]:
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

        done = await asyncio.gather(*(run(c) for c in calls))
        turn_idx = len(state.get("turns", [])) - 1
        messages = [r.to_message(c.id) for c, r in done]
        return {
            "messages": in_form(messages, thread_form(raw)),
            "tool_records": [ToolRecord(call_id=c.id, name=c.name, arguments=c.function.arguments, content=r.content,
                                        error=r.error, error_kind=r.error_kind, latency_s=r.latency_s, turn_idx=turn_idx)
                             for c, r in done],
        }

    return tool_node


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


def route_after_model(max_turns: int | None = None) -> Callable[[AgentState], str]:
    """Go to the tools when the model asked for some, else end.

    ``max_turns`` is accepted for older callers and not used here: the budget is applied after the
    tools ran (:func:`route_after_tools`), so every tool call in the thread has its result and the
    next invocation starts from a valid conversation.
    """

    def route(state: AgentState) -> str:
        messages = state.get("messages", [])
        last = messages[-1] if messages else None
        if last is None or role_of(last) != "assistant":
            return END
        calls = last.get("tool_calls") if isinstance(last, dict) else getattr(last, "tool_calls", None)
        if not calls and isinstance(last, AIMessage):
            calls = last.invalid_tool_calls
        return "tools" if calls else END

    return route


def route_after_tools(max_turns: int | None = None, model: str = "model") -> Callable[[AgentState], str]:
    """Back to the model, unless this invocation already made ``max_turns`` model calls.

    The budget is per invocation (model calls since the last user message), so a thread can go on
    indefinitely: each new user message starts a fresh budget. Only messages count, so helper
    calls that add no message (e.g. the clarifier's goal proposal) do not use it up.
    """

    def route(state: AgentState) -> str:
        if max_turns is not None and model_calls_this_invocation(state.get("messages", [])) >= max_turns:
            return END
        return model

    return route


def as_async(route: Callable[[Any], str]) -> Callable[[Any], Any]:
    """An async twin of a routing function. LangGraph runs a sync branch function of an async run
    on a thread pool (one thread hop per super-step, most of the framework's per-step cost on a busy
    machine); an async one runs on the event loop."""

    async def aroute(state: Any) -> str:
        return route(state)

    aroute.__name__ = getattr(route, "__name__", "route")
    return aroute


def wire_tool_loop(graph: Any, tools: ToolRegistry, *, approve: bool | Collection[str] = False,
                   max_turns: int | None = None, execute_tools: bool = True, model: str = "model") -> None:
    """Wire ``model ⇄ tools`` into a ``StateGraph`` that already has the ``model`` node.

    With ``execute_tools=False`` the graph ends after each model turn instead (a one-step policy
    whose tool calls an outside environment executes).
    """
    if execute_tools:
        graph.add_node("tools", make_tool_node(tools, approve=approve))
        graph.add_conditional_edges(model, as_async(route_after_model()), {"tools": "tools", END: END})
        graph.add_conditional_edges("tools", as_async(route_after_tools(max_turns, model)), {model: model, END: END})
    else:
        graph.add_edge(model, END)


__all__ = ["SAMPLING_SEED", "make_model_node", "run_params", "make_tool_node", "route_after_model",
           "route_after_tools", "model_calls_this_invocation", "approval_request", "parse_decisions",
           "stream_turn_with_callbacks", "wire_tool_loop", "as_async"]
