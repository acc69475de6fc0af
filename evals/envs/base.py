"""What the built-in environments share: option validation, action parsing, tool execution,
answer parsing, and the episode bookkeeping that keeps ``info["rewards"]`` summing to ``reward``.

The environments are small on purpose: a trainer drives thousands of episodes through them, so
each step is pure Python over a :class:`~closedloop.tool.ToolRegistry` (the same tool layer
agents use, so a malformed call gets the same error message a graph would show the model).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
import os
import random
import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from closedloop.messages import AssistantMessage, SystemMessage, ToolCall, ToolMessage, Turn, UserMessage, _Message
from closedloop.tool import ToolRegistry, ToolResult

__all__ = ["EnvOptions", "EnvOptionsError", "BuiltinEnv", "as_message", "last_number", "numbers_equal",
           "FORMAT_ERROR_KINDS", "fresh_seed"]

# Tool-layer error kinds that are the caller's fault (a format error); "exception" and "timeout"
# are the tool's own outcome (dividing by zero is a wrong step, not a malformed call).
FORMAT_ERROR_KINDS = frozenset({"malformed_json", "invalid_arguments", "unknown_tool"})

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")


class EnvOptionsError(ValueError):
    """An environment was given an unknown option or a value out of range."""


class EnvOptions(BaseModel):
    """Base of every environment's options: unknown names are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def parse(cls, options: dict[str, Any]) -> "EnvOptions":
        try:
            return cls.model_validate(options)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(options)'}: {err['msg']}"
                                 for err in e.errors())
            raise EnvOptionsError(f"invalid {cls.__name__}: {problems}. Fields: {sorted(cls.model_fields)}") from None


def as_message(action: AssistantMessage | Turn) -> AssistantMessage:
    """The assistant message of an action (a :class:`Turn` carries it)."""
    if isinstance(action, Turn):
        return action.message
    if isinstance(action, AssistantMessage):
        return action
    raise TypeError(f"an action is an AssistantMessage or a Turn, got {type(action).__name__}")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` ("7", "7.0", "-3", "1,200", "2.5e3"), or None."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:  # pragma: no cover - the pattern only matches numbers
        return None


def numbers_equal(got: float, want: float) -> bool:
    """Exact answers, up to float noise from tools typed ``float`` (``7.0`` equals ``7``)."""
    return abs(got - want) <= 1e-9 * max(1.0, abs(want))


def fresh_seed() -> int:
    """A seed for ``areset(None)``: random, but recorded in ``info["seed"]`` so the episode can be replayed."""
    return int.from_bytes(os.urandom(4), "little")


class BuiltinEnv(ABC):
    """Episode bookkeeping for the built-in environments (see :mod:`closedloop.env` for the contract).

    Subclasses set ``name``, ``Options`` and implement ``_setup(rng)`` (build the episode: returns
    the opening messages and fills ``self.registry``) and ``_act(message)`` (execute one action,
    return the new messages, this step's reward components, whether the episode terminated, and
    extra info). This class keeps the message list, counts turns, applies ``max_turns`` and the
    per-turn cost, and checks that the components sum to the reward.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type[EnvOptions]] = EnvOptions
    reward_components: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **options: Any) -> None:
        self.options = self.Options.parse(options)
        self.registry = ToolRegistry()
        self.messages: list[_Message] = []
        self.seed: int | None = None
        self.turns = 0
        self.done = True
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ to implement

    @abstractmethod
    def _setup(self, rng: random.Random) -> list[_Message]:
        ...

    @abstractmethod
    async def _act(self, message: AssistantMessage) -> tuple[list[_Message], dict[str, float], bool, dict[str, Any]]:
        ...

    @abstractmethod
    def _max_turns(self) -> int:
        ...

    def _episode_info(self) -> dict[str, Any]:
        """Counters reported in every step's info (and at reset)."""
        return {}

    def _truncation_rewards(self) -> dict[str, float]:
        """Components added on the step that hits ``max_turns`` (the episode ends unfinished)."""
        return {}

    @abstractmethod
    def expert_action(self) -> AssistantMessage:
        ...

    # ------------------------------------------------------------------ protocol

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.registry.schemas

    async def areset(self, seed: int | None = None) -> tuple[list[_Message], dict[str, Any]]:
        self.seed = fresh_seed() if seed is None else int(seed)
        self.registry = ToolRegistry()
        self.turns = 0
        self.done = False
        self.messages = list(self._setup(random.Random(self.seed)))
        info = {"tools": self.tools, "seed": self.seed, "env": self.name, "max_turns": self._max_turns(),
                **self._episode_info()}
        return list(self.messages), info

    async def astep(self, action: AssistantMessage | Turn) -> tuple[list[_Message], float, bool, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError(f"{self.name}: the episode is over (or was never started); call areset() first")
        message = as_message(action)
        self.turns += 1
        self.messages.append(message)
        new, rewards, terminated, extra = await self._act(message)
        self.messages.extend(new)
        truncated = not terminated and self.turns >= self._max_turns()
        if truncated:
            for k, v in self._truncation_rewards().items():
                rewards[k] = rewards.get(k, 0.0) + v
        rewards["turn_cost"] = -self.options.turn_cost  # type: ignore[attr-defined]
        components = {k: float(rewards.get(k, 0.0)) for k in self.reward_components}
        reward = sum(components.values())
        self.done = terminated or truncated
        info = {"rewards": components, "turn": self.turns, **self._episode_info(), **extra}
        return list(self.messages), reward, terminated, truncated, info

    # ------------------------------------------------------------------ helpers

    async def _run_calls(self, calls: list[ToolCall]) -> list[tuple[ToolCall, ToolResult]]:
        return [(call, await self.registry.call(call)) for call in calls]

    @staticmethod
    def _tool_message(call: ToolCall, result: ToolResult) -> ToolMessage:
        return result.to_message(call.id)

    # ------------------------------------------------------------------ sync API

    def _run(self, coro):
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def reset(self, seed: int | None = None) -> tuple[list[_Message], dict[str, Any]]:
        """Synchronous :meth:`areset` on a private loop (not from inside a running loop)."""
        return self._run(self.areset(seed))

    def step(self, action: AssistantMessage | Turn) -> tuple[list[_Message], float, bool, bool, dict[str, Any]]:
        """Synchronous :meth:`astep` on a private loop (not from inside a running loop)."""
        return self._run(self.astep(action))

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()


def system_and_user(system_prompt: str | None, user_text: str) -> list[_Message]:
    """The opening messages: an optional system prompt (``None`` or ``""`` leaves it out), then the request."""
    return ([SystemMessage(content=system_prompt)] if system_prompt else []) + [UserMessage(content=user_text)]
