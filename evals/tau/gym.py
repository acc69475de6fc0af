"""A gym-style environment over the same orchestrator, for trainers.

It satisfies :class:`closedloop.env.AgentEnvironment`. ``reset(seed)`` starts an episode and
returns the agent's first observation (the message list it would be prompted with); ``seed``
becomes the user simulator's sampling seed and the simulation's recorded seed (tau2's per-trial
seed). ``step(action)`` takes one agent message. The reward is sparse: 0 until the episode ends,
then the graded reward (an ungraded episode gives 0 with ``info["graded"] = False``, never a
silent 1); ``info["rewards"]`` is ``{"success": reward}`` on every step. ``truncated`` is true for
limit endings (max steps, timeout). An action is an :class:`AssistantMessage`, a :class:`Turn`,
plain text, or tau2 gym's JSON tool call ``{"name": ..., "arguments": {...}}``.

Async methods (``areset``/``astep``) are the primary API; ``reset``/``step`` run them on a private
event loop for synchronous trainers (not usable from inside a running loop).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.environment import Environment
from closedloop.evals.tau.evaluator import evaluate
from closedloop.evals.tau.orchestrator import Orchestrator, UserGuidelines, make_user
from closedloop.evals.tau.simulation import SimulationRun, TerminationReason
from closedloop.messages import AssistantMessage, ToolCall, Turn, _Message
from closedloop.models.base import ModelClient

__all__ = ["TauGymEnv", "parse_action"]

_TRUNCATIONS = {TerminationReason.MAX_STEPS, TerminationReason.TIMEOUT}


def parse_action(action: AssistantMessage | Turn | str) -> AssistantMessage | Turn:
    if isinstance(action, (AssistantMessage, Turn)):
        return action
    if not isinstance(action, str):
        raise TypeError(f"action must be an AssistantMessage, a Turn or a string, got {type(action).__name__}")
    stripped = action.strip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("name"), str) and "arguments" in data:
            return AssistantMessage(tool_calls=[ToolCall.make(data["name"], data["arguments"])])
    return AssistantMessage(content=action)


class TauGymEnv:
    def __init__(self, task: Task, user_client: ModelClient, environment_factory: Callable[[], Environment], *,
                 judge: ModelClient | None = None, guidelines: str | UserGuidelines | None = None, **orchestrator_kwargs: Any) -> None:
        self.task = task
        self.user_client = user_client
        self.environment_factory = environment_factory
        self.judge = judge
        self.guidelines = guidelines
        self.orchestrator_kwargs = orchestrator_kwargs
        self.orchestrator: Orchestrator | None = None
        self.simulation: SimulationRun | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ async API

    async def areset(self, seed: int | None = None) -> tuple[list[_Message], dict[str, Any]]:
        env = self.environment_factory()
        kwargs = dict(self.orchestrator_kwargs)
        if seed is not None:
            kwargs["seed"] = seed
        seed = kwargs.get("seed")
        user = make_user(self.task, self.user_client, guidelines=self.guidelines, seed=seed)
        self.orchestrator = Orchestrator(self.task, env, user, **kwargs)
        self.simulation = None
        await self.orchestrator.start()
        info = {"tools": [t.schema for t in self.orchestrator.tools], "policy": env.policy, "task_id": self.task.id,
                "seed": seed, "rewards": {"success": 0.0}}
        if self.orchestrator.done:
            info.update(await self._final_info())
        return self.orchestrator.agent_messages(), info

    async def astep(self, action: AssistantMessage | Turn | str) -> tuple[list[_Message], float, bool, bool, dict[str, Any]]:
        orch = self.orchestrator
        if orch is None:
            raise RuntimeError("call reset() before step()")
        if orch.done:
            raise RuntimeError("the episode is over; call reset()")
        await orch.submit(parse_action(action))
        if not orch.done:
            return orch.agent_messages(), 0.0, False, False, {"rewards": {"success": 0.0}}
        info = await self._final_info()
        truncated = orch.termination in _TRUNCATIONS
        return orch.agent_messages(), info["reward"], not truncated, truncated, info

    async def _final_info(self) -> dict[str, Any]:
        assert self.orchestrator is not None
        sim = self.orchestrator.result()
        sim.reward_info = await evaluate(sim, self.task, self.environment_factory, self.judge)
        self.simulation = sim
        graded = sim.reward_info.reward is not None
        reward = sim.reward_info.reward if graded else 0.0
        return {"reward": reward, "rewards": {"success": reward}, "graded": graded,
                "termination_reason": sim.termination_reason.value, "reward_info": sim.reward_info,
                "simulation": sim}

    # ------------------------------------------------------------------ sync API

    def _run(self, coro):
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def reset(self, seed: int | None = None) -> tuple[list[_Message], dict[str, Any]]:
        return self._run(self.areset(seed))

    def step(self, action: AssistantMessage | Turn | str) -> tuple[list[_Message], float, bool, bool, dict[str, Any]]:
        return self._run(self.astep(action))

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()
