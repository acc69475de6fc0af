"""The clarify environment: exact posterior and information gain, episodes, the expert."""

from __future__ import annotations

import itertools
import math

import pytest

from closedloop.env import AgentEnvironment
from closedloop.evals.envs import ClarifyEnv, EnvOptionsError, make_env
from closedloop.evals.envs.clarify import (LEVELS, best_question, consistent, entropy, expected_information_gain,
                                           information_gain, posterior)
from closedloop.messages import AssistantMessage, ToolCall, ToolMessage, UserMessage


def ask(attribute: str, i: int = 0) -> AssistantMessage:
    return AssistantMessage(content="", tool_calls=[ToolCall.make("ask", {"attribute": attribute}, id=f"a{i}")])


def submit(cid: str) -> AssistantMessage:
    return AssistantMessage(content="", tool_calls=[ToolCall.make("submit", {"candidate_id": cid}, id="s")])


def binary_catalogue(k: int) -> list[dict[str, str]]:
    """2^k candidates: every combination of k binary attributes, plus one constant attribute."""
    return [{**{f"a{i}": str(b) for i, b in enumerate(bits)}, "const": "x"} for bits in itertools.product("01", repeat=k)]


# --------------------------------------------------------------------------- the math


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_a_question_that_halves_a_uniform_set_gains_ln2(k):
    cands = binary_catalogue(k)
    assert entropy(posterior(cands, {})) == pytest.approx(k * math.log(2))
    assert information_gain(cands, {}, "a0", "1") == pytest.approx(math.log(2))
    assert expected_information_gain(cands, {}, "a0") == pytest.approx(math.log(2))


def test_repeated_and_constant_questions_gain_nothing():
    cands = binary_catalogue(3)
    assert information_gain(cands, {"a1": "0"}, "a1", "0") == 0.0
    assert expected_information_gain(cands, {"a1": "0"}, "a1") == 0.0
    assert information_gain(cands, {}, "const", "x") == 0.0
    assert best_question(cands, {"a0": "0", "a1": "1", "a2": "0"}, ["a0", "a1", "a2", "const"]) is None
    with pytest.raises(ValueError):
        information_gain(cands, {"a1": "0"}, "a1", "1")  # a truthful user cannot contradict itself


def test_gains_until_identification_sum_to_the_initial_entropy():
    # an uneven catalogue: gains differ per question, their sum does not
    cands = [{"c": c, "s": s} for c, s in [("r", "S"), ("r", "M"), ("r", "L"), ("b", "S"), ("g", "S")]]
    for goal in cands:
        for order in (["c", "s"], ["s", "c"]):
            answers, total = {}, 0.0
            for attr in order:
                total += information_gain(cands, answers, attr, goal[attr])
                answers[attr] = goal[attr]
            assert len(consistent(cands, answers)) == 1
            assert total == pytest.approx(math.log(len(cands)))


def test_posterior_is_uniform_over_the_consistent_candidates():
    cands = [{"c": "r"}, {"c": "r"}, {"c": "b"}]
    assert posterior(cands, {"c": "r"}) == [0.5, 0.5, 0.0]
    with pytest.raises(ValueError, match="no candidate"):
        posterior(cands, {"c": "g"})
    # expected gain = entropy of the answer's distribution: P(r)=2/3, P(b)=1/3
    assert expected_information_gain(cands, {}, "c") == pytest.approx(-(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3))


# --------------------------------------------------------------------------- episodes


async def test_protocol_and_determinism():
    env = make_env("clarify", level=3)
    assert isinstance(env, ClarifyEnv) and isinstance(env, AgentEnvironment)
    a, b = ClarifyEnv(level=3), ClarifyEnv(level=3)
    obs_a, info_a = await a.areset(11)
    obs_b, info_b = await b.areset(11)
    assert [m.model_dump() for m in obs_a] == [m.model_dump() for m in obs_b] and info_a == info_b
    assert a.goal == b.goal
    goals = set()
    for seed in range(10):
        await a.areset(seed)
        goals.add((a.category, a.goal.id, tuple(a.attributes)))
    assert len(goals) > 1


@pytest.mark.parametrize("level", sorted(LEVELS))
async def test_levels_shape_catalogue(level):
    n, k, v = LEVELS[level]
    env = ClarifyEnv(level=level)
    obs, info = await env.areset(0)
    assert info["n_candidates"] == n and len(info["attributes"]) == k and info["remaining"] == n
    rows = [tuple(c.attributes.values()) for c in env.candidates]
    assert len(set(rows)) == n  # distinct: questions can always identify the goal
    assert all(len({c.attributes[a] for c in env.candidates}) <= v for a in env.attributes)
    assert all(c.id in obs[0].text for c in env.candidates) and env.category in obs[-1].text
    assert not any(value in obs[-1].text for value in env.goal.attributes.values())  # underspecified
    assert {t["function"]["name"] for t in info["tools"]} == {"ask", "submit"}


def test_option_overrides_and_validation():
    assert ClarifyEnv(level=1, n_candidates=6).options.shape() == (6, 2, 3)
    with pytest.raises(EnvOptionsError, match="distinct candidates"):
        ClarifyEnv(n_candidates=10, n_attributes=2, n_values=3)
    with pytest.raises(EnvOptionsError):
        ClarifyEnv(info_gain=1.0)


@pytest.mark.parametrize("level", sorted(LEVELS))
async def test_expert_succeeds_with_only_informative_questions(level):
    env = ClarifyEnv(level=level, info_gain_weight=1.0)
    n, k, _ = LEVELS[level]
    for seed in range(20):
        obs, info = await env.areset(seed)
        total_ig, steps = 0.0, 0
        while True:
            obs, reward, terminated, truncated, info = await env.astep(env.expert_action())
            steps += 1
            assert math.isclose(sum(info["rewards"].values()), reward)
            assert info["rewards"]["info_gain"] == pytest.approx(info["info_gain"])
            total_ig += info["info_gain"]
            if terminated or truncated:
                break
        assert terminated and info["success"] and info["submitted"] == env.goal.id, (level, seed)
        assert info["uninformative_questions"] == 0 and 1 <= info["questions"] <= k and steps == info["questions"] + 1
        assert total_ig == pytest.approx(math.log(n)) == pytest.approx(info["total_info_gain"])


async def test_wrong_submit_scores_no_success():
    env = ClarifyEnv(level=2)
    await env.areset(4)
    wrong = next(c.id for c in env.candidates if c.id != env.goal.id)
    obs, reward, terminated, truncated, info = await env.astep(submit(wrong))
    assert terminated and not info["success"] and info["rewards"] == {"success": 0.0, "info_gain": 0.0,
                                                                       "turn_cost": -0.05}
    assert obs[-1].text.startswith("No")


async def test_uninformative_and_malformed_actions():
    env = ClarifyEnv(level=2, info_gain_weight=1.0, turn_cost=0.0, max_turns=10)
    await env.areset(2)
    attr = env.attributes[0]
    obs, reward, terminated, truncated, info = await env.astep(ask(attr))
    first_gain = info["info_gain"]
    assert obs[-1].text == f"The {attr} I want is {env.goal.attributes[attr]}." and reward == pytest.approx(first_gain)
    obs, reward, terminated, truncated, info = await env.astep(ask(attr, 1))  # repeated
    assert reward == 0.0 and info["questions"] == 2 and info["uninformative_questions"] == 1
    obs, reward, terminated, truncated, info = await env.astep(ask("flavour", 2))
    assert not terminated and obs[-1].error and "unknown attribute 'flavour'" in obs[-1].text
    assert info["questions"] == 2
    obs, *_ , info = await env.astep(submit("c999"))
    assert "no item 'c999'" in obs[-1].text and info["submitted"] is None
    obs, reward, terminated, truncated, info = await env.astep(AssistantMessage(content="Which one?"))
    assert not terminated and isinstance(obs[-1], UserMessage)
    bad_json = AssistantMessage(tool_calls=[ToolCall.make("ask", '{"attribute": ', id="x")])
    obs, *_ = await env.astep(bad_json)
    assert "not valid JSON" in obs[-1].text


async def test_calls_after_a_submit_are_not_run_and_truncation():
    env = ClarifyEnv(level=1)
    await env.areset(0)
    both = AssistantMessage(tool_calls=[ToolCall.make("submit", {"candidate_id": env.goal.id}, id="1"),
                                        ToolCall.make("ask", {"attribute": env.attributes[0]}, id="2")])
    obs, reward, terminated, truncated, info = await env.astep(both)
    assert terminated and info["success"] and info["questions"] == 0
    assert isinstance(obs[-1], ToolMessage) and obs[-1].tool_call_id == "2" and "not run" in obs[-1].text
    env = ClarifyEnv(level=1, max_turns=2)
    await env.areset(0)
    await env.astep(ask(env.attributes[0]))
    *_, terminated, truncated, info = await env.astep(ask(env.attributes[0], 1))
    assert truncated and not terminated and not info["success"]


# --------------------------------------------------------------------------- options for small models

CITIES = {"city": ["Paris", "Oslo", "Lima"], "weather": ["sunny", "rainy"], "season": ["winter", "summer"]}


async def test_value_ids_and_custom_attribute_values():
    env = ClarifyEnv(n_candidates=4, n_attributes=2, n_values=2, attribute_values=CITIES, item_ids="values",
                     turn_cost=0.0)
    obs, info = await env.areset(3)
    assert set(env.attributes) <= set(CITIES) and len(env.attributes) == 2
    for c in env.candidates:  # the id is the values in the catalogue's attribute order
        assert c.id == " ".join(c.attributes[a] for a in env.attributes)
        assert all(c.attributes[a] in CITIES[a] for a in env.attributes)
        assert f"{c.id}: " in obs[0].text
    schema = next(t for t in info["tools"] if t["function"]["name"] == "submit")
    assert repr(env.candidates[-1].id) in schema["function"]["parameters"]["properties"]["candidate_id"]["description"]
    for a in env.attributes:
        obs, *_ = await env.astep(ask(a))
    answered = " ".join(env.goal.attributes[a] for a in env.attributes)
    *_, terminated, truncated, info = await env.astep(submit(answered))  # copying the answers submits the goal
    assert terminated and info["success"] and info["submitted"] == env.goal.id
    assert ClarifyEnv(level=1).options.item_ids == "index"  # the default is unchanged


def test_attribute_values_validation():
    with pytest.raises(EnvOptionsError, match="fewer than n_attributes"):
        ClarifyEnv(n_attributes=3, n_values=2, n_candidates=4, attribute_values={"city": ["a", "b"], "size": ["s", "m"]})
    with pytest.raises(EnvOptionsError, match="at least n_values"):
        ClarifyEnv(n_attributes=2, n_values=3, n_candidates=4, attribute_values={"city": ["a", "b", "c"], "size": ["s", "m"]})
    with pytest.raises(EnvOptionsError, match="at least n_values"):
        ClarifyEnv(n_attributes=1, n_values=2, n_candidates=2, attribute_values={"city": ["a", "a"]})
    with pytest.raises(EnvOptionsError, match="lower-case"):
        ClarifyEnv(n_attributes=1, n_values=2, n_candidates=2, attribute_values={"City": ["a", "b"]})
    with pytest.raises(EnvOptionsError):
        ClarifyEnv(expert_noise=1.5)


async def _expert_episode(env: ClarifyEnv, seed: int) -> tuple[list[str], dict]:
    await env.areset(seed)
    actions = []
    while True:
        action = env.expert_action()
        actions.append(action.tool_calls[0].function.arguments)
        *_, terminated, truncated, info = await env.astep(action)
        if terminated or truncated:
            return actions, info


async def test_noisy_expert_asks_some_uninformative_questions_reproducibly():
    opts = dict(n_candidates=4, n_attributes=2, n_values=2, attribute_values=CITIES, item_ids="values")
    clean, noisy, again = ClarifyEnv(**opts), ClarifyEnv(**opts, expert_noise=0.5), ClarifyEnv(**opts, expert_noise=0.5)
    wasted = 0
    for seed in range(40):
        _, info = await _expert_episode(clean, seed)
        assert info["success"] and info["uninformative_questions"] == 0
        actions, info = await _expert_episode(noisy, seed)
        assert (actions, info) == await _expert_episode(again, seed)  # seeded by the episode
        assert info["success"] or info["uninformative_questions"] > 0  # it fails only by running out of turns
        wasted += info["uninformative_questions"]
    assert wasted > 0


async def test_a_step_that_asks_nothing_has_no_information_gain_rather_than_zero():
    """Questions (a repeated or a malformed one included) earn a gain, possibly 0; a submit or a text
    reply asks nothing, so info_gain is named inapplicable (still reported as 0.0: same keys every step)."""
    env = ClarifyEnv(level=2, info_gain_weight=1.0, turn_cost=0.0, max_turns=10)
    await env.areset(2)
    attr = env.attributes[0]
    for action in (ask(attr), ask(attr, 1), ask("flavour", 2)):
        *_, info = await env.astep(action)
        assert "inapplicable_rewards" not in info
    for action in (AssistantMessage(content="Which one?"), submit("c999"), submit(env.goal.id)):
        *_, info = await env.astep(action)
        assert info["inapplicable_rewards"] == ["info_gain"] and info["rewards"]["info_gain"] == 0.0
    assert info["success"]
