"""``calc``: arithmetic word problems solved with calculator tools.

Why this environment: it is the smallest task where an agent must call tools correctly, in the
right order, and then answer from what the tools returned, so a 150k-parameter model can learn
it on two CPU cores. Level 1 is exactly what the tiny model (:mod:`closedloop.models.tiny`) was
warmed up on: one ``add`` or ``multiply`` of two integers in 0..20, asked as "What is 3 plus 4?",
with only those two tools offered. Level ``k`` chains ``k`` operations in a word problem ("Tom
has 3 apples. Then Tom buys 4 more. Then Tom doubles them. How many ...?") with ``add``,
``subtract``, ``multiply`` and ``divide``; every intermediate value is a non-negative integer.

Protocol (see :mod:`closedloop.env`): the agent calls tools (executed here through a
:class:`~closedloop.tool.ToolRegistry`; a malformed call gets the tool layer's error message and
the episode continues), then answers in text. A text reply containing a number ends the episode
(``terminated``); a reply with no number (or an empty message) gets a user nudge and the episode
continues; ``max_turns`` actions end it unfinished (``truncated``).

Reward components (``info["rewards"]``, summing to the step's reward):

- ``success``: ``success_weight`` on the final step when the last number of the answer equals the
  target (``7``, ``7.0``, ``1,200`` accepted), else 0.
- ``format``: on the final step (answer or truncation), ``format_weight`` × the fraction of the
  episode's actions that were well formed: every tool call names a tool and has arguments that
  validate, or a text reply contains a number. Paid once per episode, so it cannot be farmed by
  making more calls.
- ``turn_cost``: ``-turn_cost`` on every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from closedloop.evals.envs.base import (FORMAT_ERROR_KINDS, BuiltinEnv, EnvOptions, last_number, numbers_equal,
                                        system_and_user)
from closedloop.messages import AssistantMessage, ToolCall, UserMessage, _Message
from closedloop.tool import Tool, tool
from closedloop.tools.arithmetic import add, multiply

__all__ = ["CalcEnv", "CalcOptions", "CalcProblem", "Step", "generate_problem", "subtract", "divide", "CALC_TOOLS",
           "MAX_LEVEL"]

MAX_LEVEL = 4


@tool(isolation="inline")  # pure arithmetic: a thread hop would cost more than the call
def subtract(a: float, b: float) -> float:
    """Subtract the second number from the first.

    Args:
        a: The number to subtract from.
        b: The number to subtract.
    """
    return a - b


@tool(isolation="inline")  # pure arithmetic: a thread hop would cost more than the call
def divide(a: float, b: float) -> float:
    """Divide the first number by the second.

    Args:
        a: The dividend.
        b: The divisor (not zero).
    """
    if b == 0:
        raise ZeroDivisionError("division by zero")
    return a / b


CALC_TOOLS: dict[str, Tool] = {"add": add, "subtract": subtract, "multiply": multiply, "divide": divide}
_APPLY = {"add": lambda x, n: x + n, "subtract": lambda x, n: x - n, "multiply": lambda x, n: x * n,
          "divide": lambda x, n: x // n}

# Level-1 phrasings: the tiny model's warm-up templates (closedloop.models.tiny.ASK), on purpose.
_ASK = {
    "add": ["What is {a} plus {b}?", "Add {a} and {b}.", "What is {a} + {b}?", "Please add {a} and {b}.",
            "Compute {a} plus {b}.", "What do you get if you add {a} and {b}?"],
    "multiply": ["What is {a} times {b}?", "Multiply {a} by {b}.", "What is {a} * {b}?",
                 "Compute {a} times {b}.", "What is the product of {a} and {b}?"],
}
_NAMES = ["Tom", "Ana", "Li", "Sam", "Maya", "Omar", "Zoe", "Ivan", "Nia", "Ben"]
_THINGS = ["apples", "marbles", "stickers", "cookies", "coins", "books", "shells", "pencils", "cards", "stamps"]
_PHRASES = {
    "add": ["Then {name} buys {n} more.", "Then {name} finds {n} more.", "Then a friend gives {name} {n} more."],
    "subtract": ["Then {name} gives away {n}.", "Then {name} loses {n}.", "Then {name} uses {n} of them."],
    "divide": ["Then {name} splits them equally into {n} boxes and keeps one box.",
               "Then {name} shares them equally among {n} friends, {name} included, and keeps one share."],
}
_MAX_VALUE = 200


@dataclass(frozen=True)
class Step:
    """One operation of a problem: ``value_before <op> operand``."""

    op: str
    value_before: int
    operand: int

    @property
    def value_after(self) -> int:
        return _APPLY[self.op](self.value_before, self.operand)


@dataclass(frozen=True)
class CalcProblem:
    level: int
    text: str
    steps: tuple[Step, ...]

    @property
    def target(self) -> int:
        return self.steps[-1].value_after


def _feasible(x: int) -> dict[str, list[int]]:
    ops = {"add": list(range(1, 21)), "multiply": [n for n in (2, 3, 4) if x * n <= _MAX_VALUE]}
    if x >= 1:
        ops["subtract"] = list(range(1, min(x, 20) + 1))
    divisors = [n for n in range(2, 7) if x % n == 0 and x // n >= 1]
    if divisors:
        ops["divide"] = divisors
    return {k: v for k, v in ops.items() if v}


def _multiply_phrase(n: int) -> str:
    return {2: "Then {name} doubles them.", 3: "Then {name} triples them."}.get(
        n, "Then {name} ends up with {n} times as many.")


def generate_problem(rng: random.Random, level: int) -> CalcProblem:
    """A problem of ``level`` operations drawn from ``rng`` (deterministic given its state)."""
    if not 1 <= level <= MAX_LEVEL:
        raise ValueError(f"calc level must be in 1..{MAX_LEVEL}, got {level}")
    if level == 1:
        op = rng.choice(["add", "multiply"])
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return CalcProblem(1, rng.choice(_ASK[op]).format(a=a, b=b), (Step(op, a, b),))
    name, things = rng.choice(_NAMES), rng.choice(_THINGS)
    x = rng.randint(2, 12)
    sentences = [f"{name} has {x} {things}."]
    steps: list[Step] = []
    for _ in range(level):
        options = _feasible(x)
        op = rng.choice(sorted(options))
        n = rng.choice(options[op])
        phrase = _multiply_phrase(n) if op == "multiply" else rng.choice(_PHRASES[op])
        sentences.append(phrase.format(name=name, n=n))
        steps.append(Step(op, x, n))
        x = steps[-1].value_after
    sentences.append(f"How many {things} does {name} have now?")
    return CalcProblem(level, " ".join(sentences), tuple(steps))


class CalcOptions(EnvOptions):
    """Options of :class:`CalcEnv` (``make_env("calc", **options)``)."""

    level: int = Field(1, ge=1, le=MAX_LEVEL, description="number of operations (1: one add/multiply, tiny-model style)")
    max_turns: int | None = Field(None, ge=1, description="actions before truncation; None: operations + 3")
    success_weight: float = Field(1.0, description="reward for an exact final answer")
    format_weight: float = Field(0.1, description="reward × fraction of well-formed actions, paid at the end")
    turn_cost: float = Field(0.01, description="cost per action (subtracted every step)")
    tool_set: Literal["level", "all"] = Field(
        "level", description="'level': add+multiply at level 1 (as the tiny model was warmed up), all four above; "
                             "'all': all four tools at every level")
    system_prompt: str | None = Field("You are a helpful assistant.", description="None or '' for no system message")
    require_number: bool = Field(True, description="a text reply without a number is nudged instead of ending the episode")


class CalcEnv(BuiltinEnv):
    """Arithmetic word problems with calculator tools; see the module docstring."""

    name = "calc"
    Options = CalcOptions
    reward_components = ("success", "format", "turn_cost")
    options: CalcOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.problem: CalcProblem | None = None

    # ------------------------------------------------------------------ episode

    def _setup(self, rng: random.Random) -> list[_Message]:
        self.problem = generate_problem(rng, self.options.level)
        names = ["add", "multiply"] if (self.options.tool_set == "level" and self.options.level == 1) else list(CALC_TOOLS)
        for n in names:
            self.registry.register(CALC_TOOLS[n])
        self.progress = 0  # plan steps done correctly, in order (the expert continues from here)
        self.last_result: str | None = None
        self.actions = self.well_formed = self.tool_calls = self.tool_errors = self.format_errors = 0
        self.answer: float | None = None
        self.success = False
        return system_and_user(self.options.system_prompt, self.problem.text)

    def _max_turns(self) -> int:
        assert self.problem is not None
        return self.options.max_turns or len(self.problem.steps) + 3

    def _format_reward(self) -> float:
        return self.options.format_weight * (self.well_formed / self.actions if self.actions else 0.0)

    def _truncation_rewards(self) -> dict[str, float]:
        return {"format": self._format_reward()}

    def _episode_info(self) -> dict[str, Any]:
        assert self.problem is not None
        return {"level": self.problem.level, "n_ops": len(self.problem.steps), "target": self.problem.target,
                "answer": self.answer, "success": self.success, "actions": self.actions,
                "well_formed_actions": self.well_formed, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "format_errors": self.format_errors}

    async def _act(self, message: AssistantMessage):
        assert self.problem is not None
        self.actions += 1
        if message.tool_calls:
            new: list[_Message] = []
            ok = True
            for call, result in await self._run_calls(message.tool_calls):
                self.tool_calls += 1
                new.append(self._tool_message(call, result))
                if not result.ok:
                    self.tool_errors += 1
                    if result.error_kind in FORMAT_ERROR_KINDS:
                        self.format_errors += 1
                        ok = False
                    continue
                self.last_result = result.content
                self._advance(call, result.value)
            self.well_formed += ok
            return new, {}, False, {}
        number = last_number(message.text)
        if number is None and (self.options.require_number or not message.text.strip()):
            self.format_errors += 1
            nudge = ("Error: your reply has no final answer. Call a tool, or give the final answer as a number."
                     if not message.text.strip() else
                     "Error: your reply has no number in it. Give the final answer as a number.")
            return [UserMessage(content=nudge)], {}, False, {}
        self.well_formed += number is not None
        self.answer = number
        self.success = number is not None and numbers_equal(number, self.problem.target)
        rewards = {"success": self.options.success_weight if self.success else 0.0, "format": self._format_reward()}
        return [], rewards, True, {"answer": self.answer, "success": self.success}

    def _advance(self, call: ToolCall, value: Any) -> None:
        """Count the call as plan progress when it is the next planned operation on the right values."""
        assert self.problem is not None
        if self.progress < len(self.problem.steps):
            step = self.problem.steps[self.progress]
            try:
                args = call.parsed_arguments()
            except (ValueError, TypeError):
                return
            if (call.name == step.op and isinstance(value, (int, float)) and numbers_equal(float(value), step.value_after)
                    and numbers_equal(float(args.get("a", "nan")), step.value_before)
                    and numbers_equal(float(args.get("b", "nan")), step.operand)):
                self.progress += 1

    # ------------------------------------------------------------------ expert

    def expert_action(self) -> AssistantMessage:
        """The next correct action: the next planned tool call, then "The answer is <last result>."."""
        if self.problem is None or self.done:
            raise RuntimeError("calc: no episode in progress")
        steps = self.problem.steps
        if self.progress < len(steps):
            step = steps[self.progress]
            call = ToolCall.make(step.op, {"a": step.value_before, "b": step.operand}, id=f"call_{self.turns}_0")
            return AssistantMessage(content="", tool_calls=[call])
        # The tool's own rendering ("7.0"), as the tiny model's warm-up answers copy it.
        shown = self.last_result if self.last_result is not None else str(self.problem.target)
        return AssistantMessage(content=f"The answer is {shown}.")
