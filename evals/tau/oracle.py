"""The gold-replay oracle: an agent that performs the task's reference actions, one tool call
per turn, then closes with a message that states every ``communicate_info`` item.

It checks the harness, not a model: on a correct domain implementation every task with a
reference trajectory must score 1 (DB match, communicate met, actions matched). The
:class:`ScenarioUser` plays the user without a model: it states the reason for the call, then
stops once the agent talks to it again.
"""

from __future__ import annotations

import itertools
from typing import Any

from closedloop.evals.tau.data_model import StructuredUserInstructions, Task
from closedloop.evals.tau.orchestrator import STOP
from closedloop.messages import AssistantMessage, ToolCall, Turn, _Message
from closedloop.models.base import ModelClient, SamplingParams, ToolChoice
from closedloop.tool import Tool

__all__ = ["OracleAgent", "ScenarioUser", "closing_message"]


def closing_message(task: Task) -> str:
    infos = (task.evaluation_criteria.communicate_info if task.evaluation_criteria else None) or []
    text = "Your request has been handled."
    if infos:
        text += " To confirm: " + "; ".join(infos) + "."
    return text


class OracleAgent:
    """``async agent(messages, tools)`` that emits the gold agent actions, then a closing message."""

    def __init__(self, task: Task) -> None:
        actions = (task.evaluation_criteria.actions if task.evaluation_criteria else None) or []
        self._actions = [a for a in actions if a.requestor == "assistant"]
        self._closing = closing_message(task)
        self._next = 0
        self._ids = itertools.count()

    async def __call__(self, messages: list[_Message], tools: list[Tool]) -> AssistantMessage:
        if self._next < len(self._actions):
            action = self._actions[self._next]
            self._next += 1
            call = ToolCall.make(action.name, action.arguments, id=f"oracle_{next(self._ids)}")
            return AssistantMessage(tool_calls=[call])
        return AssistantMessage(content=self._closing)


class ScenarioUser(ModelClient):
    """A user simulator without a model: first the task's reason for calling, then ``###STOP###``."""

    spec = "scenario-user"

    def __init__(self, task: Task) -> None:
        instructions = task.user_scenario.instructions
        self._opening = (instructions.reason_for_call if isinstance(instructions, StructuredUserInstructions)
                         else str(instructions))
        actions = (task.evaluation_criteria.actions if task.evaluation_criteria else None) or []
        self._user_actions = [a for a in actions if a.requestor == "user"]  # dual control (telecom)
        self._next = 0
        self.calls = 0

    async def generate(self, messages: list[_Message], tools: list[dict[str, Any]] | None = None,
                       params: SamplingParams | None = None, tool_choice: ToolChoice | None = None) -> Turn:
        """The opening; then, once the agent is done, the gold user actions one per message
        (when user tools are offered); then ``###STOP###``."""
        self.calls += 1
        if self.calls > 1 and tools and self._next < len(self._user_actions):
            action = self._user_actions[self._next]
            self._next += 1
            call = ToolCall.make(action.name, action.arguments, id=f"user_oracle_{self._next}")
            return Turn(message=AssistantMessage(tool_calls=[call]), model=self.spec)
        text = self._opening if self.calls == 1 else STOP
        return Turn(message=AssistantMessage(content=text), model=self.spec)
