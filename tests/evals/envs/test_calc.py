"""The calc environment: problems, tools, rewards, malformed actions, truncation."""

from __future__ import annotations

import json
import math
import random

import pytest

from closedloop.env import AgentEnvironment
from closedloop.evals.envs import CalcEnv, EnvOptionsError, last_number, make_env
from closedloop.evals.envs.calc import _ASK, generate_problem
from closedloop.messages import AssistantMessage, ToolCall, ToolMessage, Turn, UserMessage


def call(name: str, args: dict | str, i: int = 0) -> AssistantMessage:
    return AssistantMessage(content="", tool_calls=[ToolCall.make(name, args, id=f"c{i}")])


def check_sum(reward: float, info: dict) -> None:
    assert set(info["rewards"]) == {"success", "format", "turn_cost"}
    assert math.isclose(sum(info["rewards"].values()), reward, abs_tol=1e-12)


async def play_expert(env: CalcEnv, seed: int):
    obs, info = await env.areset(seed)
    steps = []
    while True:
        obs, reward, terminated, truncated, info = await env.astep(env.expert_action())
        check_sum(reward, info)
        steps.append(reward)
        if terminated or truncated:
            return obs, steps, terminated, truncated, info


def test_protocol_and_registry():
    env = make_env("calc", level=2)
    assert isinstance(env, CalcEnv) and isinstance(env, AgentEnvironment)


async def test_same_seed_same_episode_and_seeds_differ():
    a, b = CalcEnv(level=3), CalcEnv(level=3)
    obs_a, info_a = await a.areset(5)
    obs_b, info_b = await b.areset(5)
    assert [m.model_dump() for m in obs_a] == [m.model_dump() for m in obs_b] and info_a == info_b
    texts = set()
    for seed in range(6):
        obs, _ = await a.areset(seed)
        texts.add(obs[-1].text)
    assert len(texts) > 1
    _, info = await a.areset(None)  # a fresh seed, recorded so the episode can be replayed
    obs1, _ = await b.areset(info["seed"])
    assert obs1[-1].text == a.messages[-1].text


async def test_level_one_is_the_tiny_models_warmup_shape():
    env = CalcEnv(level=1)
    for seed in range(20):
        obs, info = await env.areset(seed)
        assert [t["function"]["name"] for t in info["tools"]] == ["add", "multiply"]
        (step,) = env.problem.steps
        assert step.op in ("add", "multiply") and 0 <= step.value_before <= 20 and 0 <= step.operand <= 20
        assert obs[-1].text in {t.format(a=step.value_before, b=step.operand) for t in _ASK[step.op]}
        assert info["n_ops"] == 1 and info["max_turns"] == 4


@pytest.mark.parametrize("level", [2, 3, 4])
def test_word_problems_chain_integer_steps(level):
    rng = random.Random(level)
    for _ in range(50):
        p = generate_problem(rng, level)
        assert len(p.steps) == level
        assert str(p.steps[0].value_before) in p.text and p.text.endswith("now?")
        for before, after in zip(p.steps, p.steps[1:]):
            assert after.value_before == before.value_after
        for s in p.steps:
            assert isinstance(s.value_after, int) and s.value_after >= 0
            if s.op == "divide":
                assert s.value_before % s.operand == 0


async def test_all_four_tools_above_level_one_and_on_request():
    _, info = await CalcEnv(level=2).areset(0)
    assert {t["function"]["name"] for t in info["tools"]} == {"add", "subtract", "multiply", "divide"}
    _, info = await CalcEnv(level=1, tool_set="all").areset(0)
    assert len(info["tools"]) == 4


@pytest.mark.parametrize("level", [1, 2, 3, 4])
async def test_expert_succeeds_on_every_level(level):
    env = CalcEnv(level=level)
    for seed in range(20):
        obs, steps, terminated, truncated, info = await play_expert(env, seed)
        assert terminated and not truncated and info["success"], (level, seed)
        assert info["rewards"]["success"] == 1.0 and info["rewards"]["format"] == pytest.approx(0.1)
        assert len(steps) == level + 1 and info["tool_errors"] == 0
        assert last_number(obs[-1].text) == env.problem.target


async def test_wrong_answer_scores_no_success():
    env = CalcEnv(level=2)
    await env.areset(3)
    for _ in range(2):
        await env.astep(env.expert_action())
    obs, reward, terminated, truncated, info = await env.astep(
        AssistantMessage(content=f"The answer is {env.problem.target + 1}."))
    assert terminated and not truncated and not info["success"] and info["rewards"]["success"] == 0.0
    assert info["answer"] == env.problem.target + 1
    check_sum(reward, info)
    with pytest.raises(RuntimeError, match="areset"):
        await env.astep(AssistantMessage(content="again"))


@pytest.mark.parametrize("text", ["7", "The answer is 7.0.", "It is 7.00", "So 3 + 4 = 7"])
async def test_answer_forms_accepted(text):
    env = CalcEnv(level=1)
    for seed in range(100):
        await env.areset(seed)
        if env.problem.target == 7:
            break
    *_, info = await env.astep(AssistantMessage(content=text))
    assert info["success"]


def test_last_number():
    assert last_number("3 plus 4 is 7.0.") == 7.0
    assert last_number("total: 1,200 apples") == 1200.0
    assert last_number("minus -3") == -3.0
    assert last_number("no digits") is None


async def test_malformed_calls_get_tool_errors_and_the_episode_continues():
    env = CalcEnv(level=1, format_weight=1.0, turn_cost=0.0)
    obs, _ = await env.areset(0)
    obs, reward, terminated, truncated, info = await env.astep(call("power", {"a": 1, "b": 2}))
    assert not terminated and not truncated and reward == 0.0
    assert isinstance(obs[-1], ToolMessage) and obs[-1].text.startswith("Error: unknown tool 'power'")
    assert "add" in obs[-1].text
    obs, *_ = await env.astep(call("add", '{"a": 1, "b": '))
    assert obs[-1].error and "not valid JSON" in obs[-1].text
    obs, *_ = await env.astep(call("add", {"a": "x", "b": 2}))
    assert "invalid arguments for add" in obs[-1].text
    assert info["format_errors"] == 1 and env.format_errors == 3
    obs, reward, terminated, truncated, info = await env.astep(env.expert_action())
    assert not terminated and obs[-1].text == str(float(env.problem.target)) and info["format_errors"] == 3


async def test_no_answer_is_nudged_and_format_counts_well_formed_actions():
    env = CalcEnv(level=1, format_weight=1.0, turn_cost=0.0, max_turns=10)
    await env.areset(1)
    obs, reward, terminated, truncated, info = await env.astep(AssistantMessage(content=""))
    assert not terminated and isinstance(obs[-1], UserMessage) and "no final answer" in obs[-1].text
    obs, reward, terminated, truncated, info = await env.astep(AssistantMessage(content="I am not sure."))
    assert not terminated and "no number" in obs[-1].text
    await env.astep(env.expert_action())  # the tool call
    obs, reward, terminated, truncated, info = await env.astep(env.expert_action())  # the answer
    assert terminated and info["success"]
    assert info["rewards"]["format"] == pytest.approx(2 / 4)  # 2 of 4 actions well formed


async def test_a_text_without_number_ends_the_episode_when_not_required():
    env = CalcEnv(level=1, require_number=False)
    await env.areset(1)
    *_, terminated, truncated, info = await env.astep(AssistantMessage(content="Hello!"))
    assert terminated and not info["success"] and info["answer"] is None


async def test_tool_exceptions_are_not_format_errors():
    env = CalcEnv(level=2, tool_set="all")
    await env.areset(0)
    obs, *_, info = await env.astep(call("divide", {"a": 4, "b": 0}))
    assert "ZeroDivisionError" in obs[-1].text and info["tool_errors"] == 1 and info["format_errors"] == 0


async def test_truncation_after_max_turns_and_turn_actions():
    env = CalcEnv(level=1, max_turns=2, turn_cost=0.5, format_weight=0.2)
    await env.areset(0)
    obs, reward, terminated, truncated, info = await env.astep(Turn(message=call("add", {"a": 1, "b": 1})))
    assert not truncated and reward == -0.5
    obs, reward, terminated, truncated, info = await env.astep(call("nope", {}))
    assert truncated and not terminated and not info["success"]
    assert info["rewards"] == {"success": 0.0, "format": pytest.approx(0.1), "turn_cost": -0.5}
    check_sum(reward, info)


def test_options_are_validated():
    with pytest.raises(EnvOptionsError, match="level"):
        CalcEnv(level=9)
    with pytest.raises(EnvOptionsError, match="levle"):
        CalcEnv(levle=2)


def test_sync_api():
    env = CalcEnv(level=1)
    obs, info = env.reset(seed=2)
    obs, reward, terminated, truncated, info = env.step(env.expert_action())
    assert json.loads(obs[-2].tool_calls[0].function.arguments) == {"a": env.problem.steps[0].value_before,
                                                                   "b": env.problem.steps[0].operand}
    env.close()
