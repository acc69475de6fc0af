"""Scripted expert policies and episodes as :class:`~closedloop.messages.Trajectory` records.

Why: SFT needs demonstrations before RL has anything to reinforce (the tiny model answers
"What is 3 plus 4?" by calling ``add(4, 4)``). Each built-in environment knows its own correct
next action from its state (``env.expert_action()``): ``calc`` calls the planned tools in order,
then answers from the last result; ``clarify`` asks the question of maximal expected information
gain until one candidate remains, then submits it. The expert reads the environment's state, not
the messages, so it also continues correctly from a state another policy reached (DAgger-style
relabelling).

An expert trajectory holds the final message list, one :class:`~closedloop.messages.Turn` per
action (no token ids: SFT renders the messages with the chat template), ``rewards`` (each
component summed over the episode), ``step_rewards`` (the reward of each step, index = turn) and
``metadata`` with the tool schemas (``metadata["tools"]``) SFT must render with.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable, Iterable, Union

from closedloop.env import AgentEnvironment
from closedloop.messages import AssistantMessage, Trajectory, Turn, _Message

__all__ = ["expert_action", "expert_policy", "arollout", "aexpert_trajectories", "expert_trajectories", "Policy"]

PolicyOutput = Union[AssistantMessage, Turn]
Policy = Callable[[list[_Message], dict[str, Any]], Union[PolicyOutput, Awaitable[PolicyOutput]]]

_NO_TOKENS = "scripted expert: messages only, render them with the chat template"
# info keys copied into Trajectory.metadata["final_info"] (JSON-friendly episode outcome)
_INFO_SCALARS = (bool, int, float, str, type(None))


def expert_action(env: Any) -> AssistantMessage:
    """The expert's next action in ``env``'s current state (built-in environments only)."""
    act = getattr(env, "expert_action", None)
    if act is None:
        raise TypeError(f"{type(env).__name__} has no scripted expert (expert_action)")
    return act()


def expert_policy(env: Any) -> Policy:
    """A policy (``(observation, info) -> AssistantMessage``) that plays ``env``'s expert."""
    return lambda observation, info: expert_action(env)


def _final_info(info: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in info.items():
        if k in ("tools", "rewards"):
            continue
        if isinstance(v, _INFO_SCALARS) or (isinstance(v, list) and all(isinstance(x, _INFO_SCALARS) for x in v)):
            out[k] = v
    return out


async def arollout(env: AgentEnvironment, policy: Policy, seed: int | None = None, *, model: str = "",
                   metadata: dict[str, Any] | None = None, max_steps: int = 1000) -> Trajectory:
    """Play one episode of ``env`` with ``policy`` and return it as a :class:`Trajectory`.

    ``policy(observation, info)`` returns an :class:`AssistantMessage` or a :class:`Turn` (kept as
    is, token ids included), sync or async. ``max_steps`` guards against an environment that never
    ends.
    """
    observation, info = await env.areset(seed)
    tools = info.get("tools", [])
    turns: list[Turn] = []
    step_rewards: list[float | None] = []
    totals: dict[str, float] = {}
    terminated = truncated = False
    for _ in range(max_steps):
        out = policy(observation, info)
        if inspect.isawaitable(out):
            out = await out
        turn = out if isinstance(out, Turn) else Turn(message=out, model=model,
                                                      unavailable={"token_ids": _NO_TOKENS, "logprobs": _NO_TOKENS})
        turns.append(turn)
        observation, reward, terminated, truncated, info = await env.astep(turn)
        step_rewards.append(float(reward))
        for k, v in info.get("rewards", {}).items():
            totals[k] = totals.get(k, 0.0) + float(v)
        if terminated or truncated:
            break
    else:
        raise RuntimeError(f"the episode did not end within {max_steps} steps")
    meta = {"seed": info.get("seed", seed), "tools": tools, "terminated": terminated, "truncated": truncated,
            "return": sum(r for r in step_rewards if r is not None), "final_info": _final_info(info),
            **(metadata or {})}
    return Trajectory(messages=list(observation), turns=turns, rewards=totals, step_rewards=step_rewards,
                      metadata=meta)


async def aexpert_trajectories(env_name: str, seeds: Iterable[int], level: int = 1,
                               **options: Any) -> list[Trajectory]:
    """Expert episodes of a registered environment, one per seed (see :func:`expert_trajectories`)."""
    from closedloop.evals.envs.registry import make_env

    env = make_env(env_name, level=level, **options)
    out = []
    for seed in seeds:
        traj = await arollout(env, expert_policy(env), seed, model="expert",
                              metadata={"env": env_name, "level": level, "options": dict(options), "policy": "expert"})
        out.append(traj)
    return out


def expert_trajectories(env_name: str, seeds: Iterable[int], level: int = 1, **options: Any) -> list[Trajectory]:
    """Expert episodes as SFT data: ``expert_trajectories("calc", range(100), level=2)``.

    ``options`` are the environment's options (``max_turns``, reward weights, ...). Synchronous;
    from async code use :func:`aexpert_trajectories`.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(aexpert_trajectories(env_name, seeds, level, **options))
    raise RuntimeError("expert_trajectories() was called inside a running event loop; "
                      "await aexpert_trajectories(...) instead")
