"""A scripted model: replays given assistant messages (or a function of the conversation).

For unit tests of a graph's control flow and for measuring framework overhead with a
zero-latency model. Integration tests use the real tiny model behind a real server instead.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from closedloop.messages import AssistantMessage, Turn, Usage, _Message
from closedloop.models.base import ModelClient, SamplingParams, ToolChoice

Script = Sequence[AssistantMessage] | Callable[[list[_Message]], AssistantMessage]


class ScriptedClient(ModelClient):
    """Returns the next scripted message on each call (cycling if ``cycle``)."""

    def __init__(self, script: Script, *, cycle: bool = False, name: str = "scripted") -> None:
        self.script = script
        self.cycle = cycle
        self.calls: list[list[_Message]] = []
        self.spec = f"scripted:{name}"

    async def generate(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        self.calls.append(list(messages))
        if callable(self.script):
            message = self.script(list(messages))
        else:
            i = len(self.calls) - 1
            if i >= len(self.script) and not self.cycle:
                raise IndexError(f"scripted model ran out of replies after {len(self.script)} calls")
            message = self.script[i % len(self.script)]
        return Turn(message=message.model_copy(deep=True), model=self.spec, usage=Usage(), finish_reason=(
            "tool_calls" if message.tool_calls else "stop"))
