"""User messages that carry tool calls (tau2's dual control, e.g. telecom: the user toggles
airplane mode on their own phone).

The core :class:`closedloop.messages.UserMessage` has text only; :class:`TauUserMessage` adds
``tool_calls``. Results of those calls follow as tool messages; the agent never sees either
(tau2: user tool calls and their results are hidden from the agent).
"""

from __future__ import annotations

from typing import Annotated, Any, Iterator, Sequence, Union

from pydantic import BeforeValidator, Field

from closedloop.messages import AssistantMessage, SystemMessage, ToolCall, ToolMessage, UserMessage, _Message

__all__ = ["TauUserMessage", "TauMessage", "tool_calls_of", "requestors"]


class TauUserMessage(UserMessage):
    content: Any = None
    tool_calls: list[ToolCall] | None = None


def _as_tau_user(value: Any) -> Any:
    """A plain core ``UserMessage`` is accepted where a :data:`TauMessage` is expected."""
    if isinstance(value, UserMessage) and not isinstance(value, TauUserMessage):
        return TauUserMessage(content=value.content, name=value.name)
    return value


TauMessage = Annotated[Union[SystemMessage, TauUserMessage, AssistantMessage, ToolMessage],
                       Field(discriminator="role"), BeforeValidator(_as_tau_user)]


def tool_calls_of(messages: Sequence[_Message]) -> Iterator[tuple[ToolCall, str]]:
    """Every tool call of a conversation in order, with its requestor ("assistant" or "user")."""
    for m in messages:
        calls = getattr(m, "tool_calls", None)
        if calls and isinstance(m, (AssistantMessage, UserMessage)):
            requestor = "assistant" if isinstance(m, AssistantMessage) else "user"
            for call in calls:
                yield call, requestor


def requestors(messages: Sequence[_Message]) -> dict[str, str]:
    """tool_call_id -> requestor."""
    return {call.id: who for call, who in tool_calls_of(messages)}
