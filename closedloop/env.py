"""The one environment protocol trainers and evaluations drive: gym-style, async, seeded.

Why a protocol and not a base class: τ-bench's :class:`~closedloop.evals.tau.gym.TauGymEnv`
already exists and the built-in environments (``calc``, ``clarify``) live outside the core; both
satisfy this shape without inheriting from anything in the core.

- ``areset(seed)`` → ``(observation, info)``: the message list the agent is prompted with first
  (system prompt and opening user request) and ``info["tools"]``, the OpenAI function schemas the
  agent may call.
- ``astep(action)`` → ``(observation, reward, terminated, truncated, info)``: ``action`` is the
  agent's :class:`~closedloop.messages.AssistantMessage` (or the :class:`~closedloop.messages.Turn`
  holding it); the environment executes its tool calls or lets its user reply, and returns the
  whole message list the agent sees next (what it has seen plus the new tool results / user
  reply). ``reward`` is this step's scalar reward; ``info["rewards"]`` names its components
  (``{"success": 1.0, "format": 0.1, "turn_cost": -0.05, "info_gain": 0.4}``), summing to
  ``reward``, so trainers can log each apart and place per-turn credit.

A terminated or truncated episode must be reset before the next step.

Conventions of the built-in environments (``closedloop.evals.envs``: ``calc``, ``clarify``): the
same seed gives the same episode; ``areset(None)`` draws a fresh seed and reports it in
``info["seed"]``; every step's ``info["rewards"]`` has the same keys (0.0 where a component does
not apply), so per-component logs line up, and ``info["inapplicable_rewards"]`` lists the ones
that are 0.0 only because they do not apply to this step (``clarify``'s ``info_gain`` on a step
that asks nothing), so a trainer can give that turn no per-turn reward rather than a reward of 0
(``GRPOConfig.missing_turn_rewards``); a malformed action (unknown tool, bad JSON, no
answer) is answered with an error message the agent sees, and the episode goes on.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from closedloop.messages import AssistantMessage, Turn, _Message

Observation = list[_Message]
StepOutput = tuple[Observation, float, bool, bool, dict[str, Any]]


@runtime_checkable
class AgentEnvironment(Protocol):
    """What a rollout needs of an environment (see the module docstring for the contract)."""

    async def areset(self, seed: int | None = None) -> tuple[Observation, dict[str, Any]]: ...

    async def astep(self, action: AssistantMessage | Turn) -> StepOutput: ...


__all__ = ["AgentEnvironment", "Observation", "StepOutput"]
