"""Messages at the LangGraph boundary: ours (typed, OpenAI-format) and LangChain's.

A graph's ``messages`` channel holds **LangChain messages**, always (:func:`add_any_messages`, the
channel's reducer): whatever form a caller sends (our messages, LangChain messages, OpenAI-format
dicts, LangChain's serialised dicts from Studio), the thread stores LangChain's, and a caller
reads LangChain's back. That form is chosen because the channel is LangGraph's public surface:
``add_messages`` semantics (ids, replacement by id, ``RemoveMessage``), the prebuilt ``ToolNode``
and ``tools_condition``, Studio and the LangGraph SDK all read it, and checkpointers store it
natively. Training never reads the channel: the token-exact :class:`~closedloop.messages.Turn`
records travel in their own ``turns`` channel (each ``AIMessage`` a model node writes also
carries its turn in ``response_metadata["closedloop_turn"]``).

Our nodes and clients speak our typed messages, so they convert at the boundary: on read with
:func:`as_closedloop` (cached per message object, since a thread is read again at every model
call) and on write with :func:`to_langchain`. Consumers that want ours back do the same
(``as_closedloop(out["messages"])``).

Conversions are lossless for what both sides can express: tool-call arguments keep the raw string
the model emitted (unparseable ones go to LangChain's ``invalid_tool_calls``), tool errors map to
``ToolMessage.status="error"``, reasoning to ``additional_kwargs["reasoning_content"]``.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from typing import Any, Sequence

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage
from langchain_core.messages import SystemMessage as LCSystemMessage
from langchain_core.messages import ToolMessage as LCToolMessage
from langchain_core.messages import convert_to_messages
from langgraph.graph.message import add_messages

from closedloop.messages import (AssistantMessage, SystemMessage, ToolCall, ToolMessage, Turn,
                                 UserMessage, _Message, parse_messages)

#: ``AIMessage.response_metadata`` key holding the turn (``Turn.model_dump(mode="json")``).
TURN_KEY = "closedloop_turn"

# The classes a thread is made of, by exact type: one dict lookup instead of isinstance checks
# against pydantic's and LangChain's class hierarchies (routers read every message of a thread).
_ROLE_OF_CLASS: dict[type, str] = {HumanMessage: "user", AIMessage: "assistant", LCSystemMessage: "system",
                                   LCToolMessage: "tool", UserMessage: "user", AssistantMessage: "assistant",
                                   SystemMessage: "system", ToolMessage: "tool"}

_ROLE_OF_TYPE = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool",
                 "HumanMessage": "user", "AIMessage": "assistant", "SystemMessage": "system", "ToolMessage": "tool",
                 "AIMessageChunk": "assistant", "HumanMessageChunk": "user", "ToolMessageChunk": "tool"}


def is_message(message: Any) -> bool:
    """Whether ``message`` is a chat message in some form: ours, LangChain's (or its shorthands: a
    string, a ``(role, text)`` tuple, a serialised dict) or an OpenAI-format dict."""
    return isinstance(message, (_Message, BaseMessage, dict, str, tuple, list))


def _not_a_message(message: Any) -> TypeError:
    return TypeError(f"not a chat message: {type(message).__name__} ({message!r:.80}); use one of ours, a LangChain "
                     "message or an OpenAI-format dict")


def role_of(message: Any) -> str:
    """The OpenAI role of a message in any form."""
    role = _ROLE_OF_CLASS.get(type(message))
    if role is not None:
        return role
    if isinstance(message, _Message):
        return message.role  # type: ignore[attr-defined]
    if isinstance(message, dict):
        return message.get("role") or _ROLE_OF_TYPE.get(message.get("type", ""), "")
    if isinstance(message, ChatMessage):
        return message.role
    if isinstance(message, BaseMessage):
        return _ROLE_OF_TYPE.get(message.type, message.type)
    return ""


# --------------------------------------------------------------------------- content


def _content_to_ours(content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[dict[str, Any]] = []
    for block in content:
        if isinstance(block, str):
            parts.append({"type": "text", "text": block})
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image_url":
            parts.append({"type": "image_url", "image_url": block["image_url"] if isinstance(block["image_url"], dict)
                          else {"url": block["image_url"]}})
        elif kind == "image":  # LangChain's standard block: url, or base64 + mime type
            url = block.get("url") or f"data:{block.get('mime_type', 'image/png')};base64,{block.get('base64') or block.get('data')}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "input_audio":
            parts.append(block)
        elif kind == "audio" and (block.get("base64") or block.get("data")):
            fmt = (block.get("mime_type") or "audio/wav").split("/")[-1]
            parts.append({"type": "input_audio", "input_audio": {"data": block.get("base64") or block.get("data"),
                                                                 "format": fmt}})
        # other blocks (reasoning, tool_use echoes, ...) carry nothing the OpenAI format can send
    return parts


def _content_to_langchain(content: Any) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return [p.model_dump(mode="json", exclude_none=True) for p in content]


# --------------------------------------------------------------------------- one message


# First in, first out (an OrderedDict: popping a plain dict's first key walks past every key
# deleted before it, which made each eviction cost more than the conversion it saves).
_CACHE: OrderedDict[int, tuple[BaseMessage, _Message]] = OrderedDict()
_CACHE_SIZE = 4096


def to_closedloop(message: Any) -> _Message:
    """One message in our form (raises ``TypeError``/``ValueError`` with the reason when it cannot be).

    Conversions of LangChain messages are remembered (by object, for the last few thousand), since
    a LangChain-form thread is converted again at every model call; messages in a graph's state are
    not mutated in place (LangGraph replaces them by id), so a remembered conversion stays right.
    A LangChain message made from one of ours (:func:`to_langchain`, :func:`ai_message`) is
    remembered with that message when converting it back would give an equal one
    (:func:`_round_trips`): the tool node, the recorder and the next model call then read the very
    object the model node produced (``turn.message``) at no cost.
    """
    hit = _CACHE.get(id(message))
    if hit is not None and hit[0] is message:
        return hit[1]
    if isinstance(message, _Message):
        return message
    if isinstance(message, BaseMessage):
        converted = _to_closedloop(message)
        _remember(message, converted)
        return converted
    return _to_closedloop(message)


def _remember(message: BaseMessage, converted: _Message) -> None:
    if len(_CACHE) >= _CACHE_SIZE:
        try:
            _CACHE.popitem(last=False)
        except KeyError:  # emptied by another thread meanwhile
            pass
    _CACHE[id(message)] = (message, converted)


def _to_closedloop(message: Any) -> _Message:
    if isinstance(message, dict):
        if "role" in message:
            return parse_messages([{k: v for k, v in message.items() if k != "id"}])[0]
        message = convert_to_messages([message])[0]
    elif not isinstance(message, BaseMessage):
        if not is_message(message):
            raise _not_a_message(message)
        message = convert_to_messages([message])[0]
    role = role_of(message)
    content = _content_to_ours(message.content)
    if role == "user":
        return UserMessage(content=content, name=message.name or None)
    if role == "system":
        return SystemMessage(content=content)
    if role == "assistant":
        return _assistant_to_ours(message, content)
    if role == "tool":
        error = (message.additional_kwargs or {}).get("error")
        if error is None and getattr(message, "status", "success") == "error":
            error = content if isinstance(content, str) else json.dumps(content)
        return ToolMessage(tool_call_id=message.tool_call_id, content=content, name=message.name or None, error=error)
    raise ValueError(f"cannot convert a {type(message).__name__} with role {role!r} to a chat message")


def _assistant_to_ours(message: BaseMessage, content: Any) -> AssistantMessage:
    calls: list[ToolCall] = []
    raw = (message.additional_kwargs or {}).get("tool_calls")
    if isinstance(message, AIMessage):
        for tc in message.tool_calls:
            calls.append(ToolCall.make(tc["name"], tc.get("args") or {}, tc.get("id")))
        for itc in message.invalid_tool_calls:
            calls.append(ToolCall.make(itc.get("name") or "", itc.get("args") or "", itc.get("id")))
        # The raw OpenAI tool calls (when a converter kept them) hold the exact argument strings,
        # in the order the model emitted them (LangChain splits valid from malformed calls).
        if raw and len(raw) == len(calls):
            by_id = {c.get("id"): c for c in raw if isinstance(c, dict)}
            if set(by_id) == {c.id for c in calls}:
                order = {call_id: i for i, call_id in enumerate(by_id)}
                calls.sort(key=lambda c: order[c.id])
            for call in calls:
                original = by_id.get(call.id, {}).get("function", {})
                if isinstance(original.get("arguments"), str):
                    call.function.arguments = original["arguments"]
    reasoning = (message.additional_kwargs or {}).get("reasoning_content")
    if content == "" and calls:
        content = None
    return AssistantMessage(content=content, tool_calls=calls or None, reasoning=reasoning)


def to_langchain(message: Any, turn: Turn | None = None) -> BaseMessage:
    """One message as a LangChain message; an assistant message can carry its ``turn`` in metadata."""
    if isinstance(message, BaseMessage):
        return message
    if isinstance(message, dict) and "role" not in message:
        return convert_to_messages([message])[0]
    m = to_closedloop(message)
    if isinstance(m, AssistantMessage):
        return ai_message(m, turn)
    content = _content_to_langchain(getattr(m, "content", None))
    out: BaseMessage
    if isinstance(m, UserMessage):
        out = HumanMessage(content=content, **({"name": m.name} if m.name else {}))
    elif isinstance(m, SystemMessage):
        out = LCSystemMessage(content=content)
    elif isinstance(m, ToolMessage):
        out = LCToolMessage(content=content, tool_call_id=m.tool_call_id, name=m.name,
                            status="error" if m.error else "success",
                            additional_kwargs={"error": m.error} if m.error else {})
    else:
        raise ValueError(f"cannot convert a {type(m).__name__} to a LangChain message")
    if _round_trips(m):
        _remember(out, m)
    return out


def _round_trips(m: _Message) -> bool:
    """Whether converting ``to_langchain(m)`` back gives a message equal to ``m`` (what lets the
    conversion be remembered at no cost). Conservative: plain-text content, and none of the
    values the LangChain form cannot tell apart (an empty name, reasoning or error is stored as
    absent; an assistant's ``""`` beside tool calls is read back as ``None``, and ``None``
    without them as ``""``; duplicate call ids)."""
    content = getattr(m, "content", None)
    if isinstance(m, AssistantMessage):
        calls = m.tool_calls
        if calls is not None and (not calls or not all(c.id for c in calls)
                                  or len({c.id for c in calls}) != len(calls)):
            return False
        if content is None:
            return bool(calls) and m.reasoning != ""
        return type(content) is str and (content != "" or not calls) and m.reasoning != ""
    if type(content) is not str or getattr(m, "name", None) == "":
        return False
    return not isinstance(m, ToolMessage) or m.error != ""


def ai_message(m: AssistantMessage, turn: Turn | None = None) -> AIMessage:
    """Our assistant message as an ``AIMessage``, carrying ``turn`` (when given) in its metadata."""
    content = _content_to_langchain(m.content)
    tool_calls: list[Any] = []
    invalid: list[Any] = []
    for call in m.tool_calls or []:
        try:
            args = call.parsed_arguments()
            tool_calls.append({"name": call.name, "args": args, "id": call.id, "type": "tool_call"})
        except (ValueError, TypeError) as e:
            invalid.append({"name": call.name, "args": call.function.arguments, "id": call.id,
                            "error": f"{type(e).__name__}: {e}", "type": "invalid_tool_call"})
    extra: dict[str, Any] = {}
    if m.tool_calls:  # exact argument strings; ToolCall.model_dump(mode="json"), built directly
        extra["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                                          "arguments": c.function.arguments}}
                               for c in m.tool_calls]
    if m.reasoning:
        extra["reasoning_content"] = m.reasoning
    metadata: dict[str, Any] = {}
    usage = None
    if turn is not None:
        metadata = {"model_name": turn.model, "finish_reason": turn.finish_reason,
                    TURN_KEY: turn.model_dump(mode="json")}
        usage = {"input_tokens": turn.usage.prompt_tokens, "output_tokens": turn.usage.completion_tokens,
                 "total_tokens": turn.usage.total_tokens}
    ai = AIMessage(content=content, tool_calls=tool_calls, invalid_tool_calls=invalid, additional_kwargs=extra,
                   response_metadata=metadata, **({"usage_metadata": usage} if usage else {}))
    if _round_trips(m):
        _remember(ai, m)
    return ai


def to_openai(message: Any) -> dict[str, Any]:
    """One message as an OpenAI-format dict (tool errors and reasoning, which OpenAI has no field for, dropped)."""
    if isinstance(message, dict) and "role" in message:
        return message
    return to_closedloop(message).to_openai()


def turn_of(message: Any) -> Turn | None:
    """The turn an ``AIMessage`` (or its dict) carries in its metadata, if any."""
    meta = message.get("response_metadata") if isinstance(message, dict) else getattr(message, "response_metadata", None)
    data = (meta or {}).get(TURN_KEY)
    if data is None:
        return None
    return data if isinstance(data, Turn) else Turn.model_validate(data)


def action_of(message: Any) -> Turn | AssistantMessage:
    """What a one-step policy's last message hands an environment: the turn it carries (a model's
    reply, token-exact), else the message itself in our form (one the graph composed)."""
    turn = turn_of(message)
    if turn is not None:
        return turn
    ours = to_closedloop(message)
    return ours if isinstance(ours, AssistantMessage) else AssistantMessage(content=ours.text)


# --------------------------------------------------------------------------- lists


def as_closedloop(messages: Sequence[Any]) -> list[_Message]:
    """A message list in our form; free when it already is."""
    if messages and isinstance(messages[0], _Message) and isinstance(messages[-1], _Message):
        return list(messages)
    return [to_closedloop(m) for m in messages]


def as_langchain(messages: Any) -> list[Any]:
    """Messages (one or a list, any form) as LangChain messages; ``RemoveMessage`` and LangChain's
    own shorthands (strings, ``(role, text)`` tuples, serialised dicts) pass to ``add_messages``."""
    items = list(messages) if isinstance(messages, (list, tuple)) else ([] if messages is None else [messages])
    out = []
    for m in items:
        if isinstance(m, _Message) or (isinstance(m, dict) and "role" in m):
            out.append(to_langchain(m))
        elif is_message(m):
            out.append(m)
        else:
            raise _not_a_message(m)
    return out


def _stored(left: Any) -> list[Any]:
    """The channel's current list: already LangChain's (it holds nothing else, so its ends tell),
    or a thread checkpointed in our form before the channel was LangChain's, converted now."""
    if isinstance(left, list) and (not left or (isinstance(left[0], BaseMessage) and isinstance(left[-1], BaseMessage))):
        return left
    return as_langchain(left)


# Plain LangChain message classes (chunks and ``RemoveMessage`` are subclasses, so not among them).
_PLAIN = frozenset({HumanMessage, AIMessage, LCSystemMessage, LCToolMessage, ChatMessage})


def add_any_messages(left: Any, right: Any) -> list[Any]:
    """The ``messages`` channel's reducer: LangGraph's ``add_messages`` over LangChain messages,
    taking any form on either side.

    What a node adds is almost always new messages appended to a thread: ``add_messages`` then
    only gives those without an id a uuid4 one and appends them, but first walks the whole
    thread through its coercions and builds an index by id, work in the length of the thread
    at every step (LangGraph runs the reducer twice a step: once more for the routers, which read
    the state with the step's writes). That case (:func:`_only_appends`) is done here directly,
    with the same result (ids given in the same order, by the same mutation); anything else goes
    to ``add_messages``."""
    left, right = _stored(left), as_langchain(right)
    if _only_appends(left, right):
        for m in right:
            if m.id is None:
                m.id = str(uuid.uuid4())
        return left + right
    return add_messages(left, right)  # type: ignore[arg-type,return-value]


def _only_appends(left: list[Any], right: list[Any]) -> bool:
    """Whether ``add_messages(left, right)`` would append ``right`` as it is: plain messages on
    both sides (no chunk to convert, no ``RemoveMessage``), every thread message with its id, and
    none of the new ones replacing a message by id (an id of the thread, or one given twice, or
    one message object twice)."""
    if not right or not all(type(m) in _PLAIN for m in right) or not set(map(type, left)) <= _PLAIN:
        return False
    ids = {m.id for m in left}
    if None in ids:
        return False
    given = [m.id for m in right if m.id is not None]
    if len(right) > 1 and (len(set(map(id, right))) != len(right) or len(set(given)) != len(given)):
        return False
    return ids.isdisjoint(given)


__all__ = ["TURN_KEY", "is_message", "role_of", "to_closedloop", "to_langchain", "ai_message", "to_openai", "turn_of",
           "as_closedloop", "as_langchain", "add_any_messages",
           "action_of"]
