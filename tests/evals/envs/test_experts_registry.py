"""Expert trajectories as SFT data, generic rollouts, and the environment registry."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from closedloop.evals.envs import (ENV_GROUP, CalcEnv, ClarifyEnv, aexpert_trajectories, arollout, available_envs,
                                   expert_action, expert_trajectories, make_env)
from closedloop.evals.envs.registry import UnknownEnvironment
from closedloop.messages import AssistantMessage, ToolCall, Trajectory, Turn, to_openai_messages
from closedloop.models.tiny import _render_plain

ROOT = Path(__file__).resolve().parents[3]


def test_registry_names_and_errors():
    assert {"calc", "clarify"} <= set(available_envs())
    assert isinstance(make_env("clarify", level=2, info_gain_weight=0.5), ClarifyEnv)
    with pytest.raises(UnknownEnvironment, match="available: .*calc"):
        make_env("chess")


def test_entry_points_are_declared_for_the_builtins():
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    declared = groups[ENV_GROUP]
    assert set(declared) >= {"calc", "clarify"}
    for name in ("calc", "clarify"):  # the registry resolves the built-ins from these declarations
        assert available_envs()[name] == declared[name]
    assert type(make_env("calc")) is CalcEnv


@pytest.mark.parametrize("name,level", [("calc", 1), ("calc", 4), ("clarify", 1), ("clarify", 4)])
def test_expert_trajectories_are_complete_sft_records(name, level):
    trajs = expert_trajectories(name, range(5), level=level)
    assert len(trajs) == 5 and all(isinstance(t, Trajectory) for t in trajs)
    for seed, t in enumerate(trajs):
        assert t.metadata["seed"] == seed and t.metadata["env"] == name and t.metadata["level"] == level
        assert t.metadata["final_info"]["success"] is True and t.metadata["terminated"]
        assistant = [m for m in t.messages if m.role == "assistant"]
        assert [turn.message for turn in t.turns] == assistant
        assert len(t.step_rewards) == len(t.turns)
        assert math.isclose(sum(t.rewards.values()), sum(t.step_rewards))
        assert t.rewards["success"] == 1.0 and all(not turn.has_tokens for turn in t.turns)
        assert Trajectory.from_json(t.to_json()) == t
        # renders with the tiny model's chat template, tools included
        text = _render_plain(to_openai_messages(t.messages), t.metadata["tools"])
        assert "<tool_call>" in text and "<tools>" in text


def test_expert_trajectories_are_deterministic():
    a = expert_trajectories("calc", [3, 4], level=3)
    b = expert_trajectories("calc", [3, 4], level=3)
    assert [t.messages for t in a] == [t.messages for t in b] and [t.rewards for t in a] == [t.rewards for t in b]
    c = expert_trajectories("clarify", [3], level=2, info_gain_weight=1.0)
    assert c[0].rewards["info_gain"] == pytest.approx(math.log(8)) and c[0].metadata["options"] == {"info_gain_weight": 1.0}


async def test_async_variant_and_the_sync_guard():
    trajs = await aexpert_trajectories("calc", [0], level=1)
    assert trajs[0].messages[-1].text.startswith("The answer is")
    with pytest.raises(RuntimeError, match="aexpert_trajectories"):
        expert_trajectories("calc", [0])


async def test_rollout_keeps_policy_turns_and_counts_failures():
    env = CalcEnv(level=1)

    async def policy(observation, info):  # always answers 0: wrong unless the target is 0
        return Turn(message=AssistantMessage(content="The answer is 0."), model="m", prompt_ids=[1], completion_ids=[2],
                    logprobs=[-0.5])

    traj = await arollout(env, policy, seed=1, metadata={"stage": "base"})
    assert traj.turns[0].completion_ids == [2] and traj.metadata["stage"] == "base"
    assert traj.metadata["final_info"]["success"] is (env.problem.target == 0)


def test_expert_action_needs_an_episode():
    with pytest.raises(RuntimeError, match="no episode"):
        expert_action(CalcEnv())
    with pytest.raises(TypeError, match="no scripted expert"):
        expert_action(object())


async def test_expert_continues_from_a_state_another_policy_reached():
    env = CalcEnv(level=2)
    await env.areset(7)
    step = env.problem.steps[0]
    wrong = AssistantMessage(tool_calls=[ToolCall.make(step.op, {"a": step.value_before + 1, "b": step.operand}, id="w")])
    await env.astep(wrong)  # a wrong first call: the expert redoes the right one
    action = expert_action(env)
    assert action.tool_calls[0].parsed_arguments() == {"a": step.value_before, "b": step.operand}
