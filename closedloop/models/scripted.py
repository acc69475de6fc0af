"""A scripted model: replays given assistant messages or whole turns (or a function of the conversation).

For unit tests of a graph's control flow, for checking that a turn's token record travels
unchanged (a scripted :class:`Turn` with its ids and logprobs is replayed as given), and for
measuring framework overhead with a zero-latency model. Integration tests use the real tiny
model behind a real server instead.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from closedloop.messages import AssistantMessage, Turn, Usage, _Message
from closedloop.models.base import ModelClient, SamplingParams, ToolChoice

Reply = AssistantMessage | Turn
Script = Sequence[Reply] | Callable[[list[_Message]], Reply]


class ScriptedClient(ModelClient):
    """Returns the next scripted reply on each call (cycling if ``cycle``): an assistant message
    becomes a turn without token ids; a turn is returned as given (a deep copy, so a caller that
    changes what it got never changes the script)."""

    def __init__(self, script: Script, *, cycle: bool = False, name: str = "scripted") -> None:
        self.script = script
        self.cycle = cycle
        self.calls: list[list[_Message]] = []
        self.spec = f"scripted:{name}"

    async def generate(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        self.calls.append(list(messages))
        reply: Reply
        if callable(self.script):
            reply = self.script(list(messages))
        else:
            i = len(self.calls) - 1
            if i >= len(self.script) and not self.cycle:
                raise IndexError(f"scripted model ran out of replies after {len(self.script)} calls")
            reply = self.script[i % len(self.script)]
        if isinstance(reply, Turn):
            return reply.model_copy(deep=True)
        return Turn(message=reply.model_copy(deep=True), model=self.spec, usage=Usage(), finish_reason=(
            "tool_calls" if reply.tool_calls else "stop"))
