"""Messages in three forms, one conversation: ours, LangChain's, and OpenAI-format dicts.

A graph's ``messages`` channel accepts all three (:func:`merge_messages`, an ``add_messages``-
compatible reducer) and keeps the thread in the form its first message came in, so a caller reads
back what it sent: our pydantic messages, LangChain ``BaseMessage``s (needed by
``langgraph.prebuilt.ToolNode``/``tools_condition`` and rendered by Studio), or OpenAI dicts
(``{"role": ..., "content": ...}``). Dicts in LangChain's serialised shape (``{"type": "human", ...}``,
what Studio sends) count as LangChain. Our nodes read any form through :func:`as_closedloop` and
write back in the thread's form; the token-exact :class:`~closedloop.messages.Turn` records are
kept in their own channel whatever the form, so training never depends on the message form.

Conversions are lossless for what both sides can express: tool-call arguments keep the raw string
the model emitted (unparseable ones go to LangChain's ``invalid_tool_calls``), tool errors map to
``ToolMessage.status="error"``, a turn rides in ``AIMessage.response_metadata["closedloop_turn"]``.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Sequence

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, RemoveMessage
from langchain_core.messages import SystemMessage as LCSystemMessage
from langchain_core.messages import ToolMessage as LCToolMessage
from langchain_core.messages import convert_to_messages
from langgraph.graph.message import REMOVE_ALL_MESSAGES, add_messages

from closedloop.messages import (AssistantMessage, FunctionCall, SystemMessage, ToolCall, ToolMessage, Turn,
                                 UserMessage, _Message, parse_messages)

Form = Literal["closedloop", "langchain", "openai"]

#: ``AIMessage.response_metadata`` key holding the turn (``Turn.model_dump(mode="json")``).
TURN_KEY = "closedloop_turn"

_ROLE_OF_TYPE = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool",
                 "HumanMessage": "user", "AIMessage": "assistant", "SystemMessage": "system", "ToolMessage": "tool",
                 "AIMessageChunk": "assistant", "HumanMessageChunk": "user", "ToolMessageChunk": "tool"}


def form_of(message: Any) -> Form:
    """Which form one message is in (a string or ``(role, text)`` tuple is LangChain's shorthand)."""
    if isinstance(message, _Message):
        return "closedloop"
    if isinstance(message, dict):
        return "openai" if "role" in message else "langchain"
    if isinstance(message, (BaseMessage, str, tuple, list)):
        return "langchain"
    raise TypeError(f"not a chat message: {type(message).__name__} ({message!r:.80}); use one of ours, a LangChain "
                    "message or an OpenAI-format dict")


def role_of(message: Any) -> str:
    """The OpenAI role of a message in any form."""
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


_CACHE: dict[int, tuple[BaseMessage, _Message]] = {}
_CACHE_SIZE = 4096


def to_closedloop(message: Any) -> _Message:
    """One message in our form (raises ``TypeError``/``ValueError`` with the reason when it cannot be).

    Conversions of LangChain messages are remembered (by object, for the last few thousand), since
    a LangChain-form thread is converted again at every model call; messages in a graph's state are
    not mutated in place (LangGraph replaces them by id), so a remembered conversion stays right.
    """
    if isinstance(message, _Message):
        return message
    if isinstance(message, BaseMessage):
        hit = _CACHE.get(id(message))
        if hit is not None and hit[0] is message:
            return hit[1]
        converted = _to_closedloop(message)
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[id(message)] = (message, converted)
        return converted
    return _to_closedloop(message)


def _to_closedloop(message: Any) -> _Message:
    if isinstance(message, dict):
        if "role" in message:
            return parse_messages([{k: v for k, v in message.items() if k != "id"}])[0]
        message = convert_to_messages([message])[0]
    elif not isinstance(message, BaseMessage):
        form_of(message)  # a clear TypeError for what is no message at all
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
            calls.append(ToolCall(id=tc.get("id") or ToolCall.model_fields["id"].default_factory(),
                                  function=FunctionCall(name=tc["name"], arguments=json.dumps(tc.get("args") or {}))))
        for tc in message.invalid_tool_calls:
            calls.append(ToolCall(id=tc.get("id") or ToolCall.model_fields["id"].default_factory(),
                                  function=FunctionCall(name=tc.get("name") or "", arguments=tc.get("args") or "")))
        # The raw OpenAI tool calls (when a converter kept them) hold the exact argument strings.
        if raw and len(raw) == len(calls):
            by_id = {c.get("id"): c for c in raw if isinstance(c, dict)}
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
    content = _content_to_langchain(getattr(m, "content", None))
    if isinstance(m, UserMessage):
        return HumanMessage(content=content, **({"name": m.name} if m.name else {}))
    if isinstance(m, SystemMessage):
        return LCSystemMessage(content=content)
    if isinstance(m, ToolMessage):
        return LCToolMessage(content=content, tool_call_id=m.tool_call_id, name=m.name,
                             status="error" if m.error else "success",
                             additional_kwargs={"error": m.error} if m.error else {})
    assert isinstance(m, AssistantMessage)
    tool_calls, invalid = [], []
    for call in m.tool_calls or []:
        try:
            args = call.parsed_arguments()
            tool_calls.append({"name": call.name, "args": args, "id": call.id, "type": "tool_call"})
        except (ValueError, TypeError) as e:
            invalid.append({"name": call.name, "args": call.function.arguments, "id": call.id,
                            "error": f"{type(e).__name__}: {e}", "type": "invalid_tool_call"})
    extra: dict[str, Any] = {}
    if m.tool_calls:
        extra["tool_calls"] = [c.model_dump(mode="json") for c in m.tool_calls]  # exact argument strings
    if m.reasoning:
        extra["reasoning_content"] = m.reasoning
    metadata: dict[str, Any] = {}
    usage = None
    if turn is not None:
        metadata = {"model_name": turn.model, "finish_reason": turn.finish_reason,
                    TURN_KEY: turn.model_dump(mode="json")}
        usage = {"input_tokens": turn.usage.prompt_tokens, "output_tokens": turn.usage.completion_tokens,
                 "total_tokens": turn.usage.total_tokens}
    return AIMessage(content=content, tool_calls=tool_calls, invalid_tool_calls=invalid, additional_kwargs=extra,
                     response_metadata=metadata, **({"usage_metadata": usage} if usage else {}))


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


# --------------------------------------------------------------------------- lists


def thread_form(messages: Sequence[Any]) -> Form:
    """The form of a thread: that of its first message (ours when empty)."""
    return form_of(messages[0]) if messages else "closedloop"


def as_closedloop(messages: Sequence[Any]) -> list[_Message]:
    """A message list in our form; free when it already is."""
    if messages and isinstance(messages[0], _Message) and isinstance(messages[-1], _Message):
        return list(messages)
    return [to_closedloop(m) for m in messages]


def in_form(messages: Sequence[_Message], form: Form, turns: Sequence[Turn | None] | None = None) -> list[Any]:
    """Our messages converted to ``form`` (assistant messages paired with their ``turns`` when given)."""
    if form == "closedloop":
        return list(messages)
    if form == "openai":
        return [m.to_openai() for m in messages]
    turns = list(turns or [])
    return [to_langchain(m, turns[i] if i < len(turns) else None) for i, m in enumerate(messages)]


def convert_to(message: Any, form: Form) -> Any:
    if form == "closedloop":
        return to_closedloop(message)
    if form == "openai":
        return to_openai(message)
    return to_langchain(message)


def merge_messages(left: Any, right: Any) -> list[Any]:
    """Append ``right`` to ``left``, converting it to the thread's form (``add_messages``-compatible).

    In the LangChain form this is LangGraph's ``add_messages`` itself (ids, replacement by id,
    ``RemoveMessage``). Our and the OpenAI form have no message ids, so they append; a
    ``RemoveMessage(id=REMOVE_ALL_MESSAGES)`` clears the thread in every form.
    """
    left = list(left) if isinstance(left, (list, tuple)) else ([] if left is None else [left])
    right = list(right) if isinstance(right, (list, tuple)) else ([] if right is None else [right])
    if not right:
        return left
    for i in range(len(right) - 1, -1, -1):
        m = right[i]
        if isinstance(m, RemoveMessage) and m.id == REMOVE_ALL_MESSAGES:
            left, right = [], right[i + 1:]
            if not right:
                return []
            break
    form = thread_form(left) if left else thread_form(right)
    if form == "closedloop":
        if all(isinstance(m, _Message) for m in right):
            return left + right
    if form == "langchain":
        return add_messages(left, [m if isinstance(m, BaseMessage) else to_langchain(m) for m in right])
    for m in right:
        if isinstance(m, RemoveMessage):
            raise ValueError(f"a thread of {form} messages has no message ids: only RemoveMessage(id="
                             f"REMOVE_ALL_MESSAGES) can remove messages from it")
    return left + [convert_to(m, form) for m in right]


__all__ = ["Form", "TURN_KEY", "form_of", "role_of", "to_closedloop", "to_langchain", "to_openai", "turn_of",
           "thread_form", "as_closedloop", "in_form", "convert_to", "merge_messages"]
