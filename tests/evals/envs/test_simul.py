"""simul: the latency-aware reward is monotone in emission delay; lag metrics on hand computations;
the environment's episodes, experts and wait-k baselines."""

from __future__ import annotations

import random

import pytest

from closedloop.evals.envs import make_env
from closedloop.evals.envs.experts import expert_trajectories
from closedloop.evals.envs.simul import (LEXICON, PLACEHOLDER, SentencePair, SimulEnv, average_lagging,
                                         deadline_bleu, delayed_emissions, differentiable_average_lagging,
                                         length_adaptive_average_lagging, make_sentence, oracle_emissions,
                                         score_emissions, sentence_bleu, split_sentences, wait_k_emissions)
from closedloop.messages import AssistantMessage

PAIR = SentencePair(("Paris", "sunny", "add", "."), ("robot", "get", "watch", "."), (1, 3, 3, 4))


def _reward(emissions, sentences, **kw) -> float:
    sc = score_emissions(emissions, sentences, **kw)
    return sc.quality + sc.lag


def _delay(emissions, rng: random.Random):
    """Same words, each emitted at the same step or later (order kept)."""
    out, prev = [], 0
    for t, w in emissions:
        t2 = max(prev, t + (rng.randint(0, 3) if rng.random() < 0.5 else 0))
        out.append((t2, w))
        prev = t2
    return out


def test_reward_never_increases_when_the_same_content_is_emitted_later():
    rng = random.Random(0)
    vocab = [w for role in LEXICON.values() for w in role.values()] + [".", "."]
    strictly_lower = 0
    for case in range(400):
        sentences = [make_sentence(rng) for _ in range(rng.randint(1, 3))]
        n_src = 4 * len(sentences)
        if rng.random() < 0.5:  # near-correct content (so BLEU is not always 0), sometimes corrupted
            words = [w for s in sentences for w in s.target]
            words = [rng.choice(vocab) if rng.random() < 0.2 else w for w in words]
        else:
            words = [rng.choice(vocab) for _ in range(rng.randint(0, 12))]
        times = sorted(rng.randint(1, n_src + 2) for _ in words)
        emissions = list(zip(times, words))
        kw = dict(delta=rng.randint(0, 2), lag_weight=rng.choice([0.0, 0.5, 2.0]))
        before = _reward(emissions, sentences, **kw)
        for _ in range(3):
            later = _delay(emissions, rng)
            after = _reward(later, sentences, **kw)
            assert after <= before + 1e-9, (case, emissions, later, before, after)
            strictly_lower += after < before - 1e-9
    assert strictly_lower > 100  # the property is not vacuous: delays usually cost


def test_late_words_count_as_misses_not_as_absent():
    # a correct sentence followed by a wrong word: dropping the late wrong word would raise BLEU,
    # the placeholder keeps the length and cannot match
    ref = ["a", "b", "c", "d"]
    on_time = deadline_bleu(["a", "b", "c", "d", "x"], [1, 1, 1, 1, 1], ref, deadline=1)
    wrong_late = deadline_bleu(["a", "b", "c", "d", "x"], [1, 1, 1, 1, 5], ref, deadline=1)
    assert wrong_late == pytest.approx(on_time)  # x is wrong either way
    assert sentence_bleu(["a", "b", "c", "d"], ref) > wrong_late  # a model that dropped it would gain
    late_period = deadline_bleu(ref, [1, 1, 1, 2], ref, deadline=1)
    assert late_period == pytest.approx(sentence_bleu(["a", "b", "c", PLACEHOLDER], ref))
    assert deadline_bleu(ref, [1, 1, 1, 2], ref, deadline=1) < 100.0


def test_lag_metrics_hand_computed():
    # wait-k on equal lengths: AL = k (Ma et al.)
    for k in (1, 2, 3):
        delays = [min(k + i, 6) for i in range(6)]
        assert average_lagging(delays, 6) == pytest.approx(k)
    # AL cut-off: only up to the first word written after the full source (g = 4 at i = 2)
    assert average_lagging([1, 3, 4, 4], 4) == pytest.approx(((1 - 0) + (3 - 1) + (4 - 2)) / 3)
    # LAAL uses max(|y|, |y*|): a short output cannot look faster by being short
    assert length_adaptive_average_lagging([2, 4], 4, 4) == pytest.approx(((2 - 0) + (4 - 1)) / 2)
    assert average_lagging([2, 4], 4) == pytest.approx(((2 - 0) + (4 - 2)) / 2)
    # DAL: g' = (1, 3, 4, 5) for delays (1, 3, 3, 4) with gamma = 1 -> (1 + 2 + 2 + 2) / 4
    assert differentiable_average_lagging([1, 3, 3, 4], 4) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="non-decreasing"):
        average_lagging([3, 2], 4)
    with pytest.raises(ValueError, match="non-decreasing"):
        score_emissions([(3, "a"), (2, "b")], [PAIR])


def test_reference_policies_trade_quality_for_lag():
    sents = [PAIR, PAIR]
    oracle, delayed = score_emissions(oracle_emissions(sents), sents), score_emissions(delayed_emissions(sents), sents)
    assert oracle.metrics()["bleu"] == pytest.approx(100) and delayed.metrics()["bleu"] == pytest.approx(100)
    assert oracle.metrics()["dal"] == pytest.approx(1.75) and delayed.metrics()["dal"] == pytest.approx(4.0)
    wait1 = score_emissions(wait_k_emissions(sents, 1), sents)
    assert wait1.metrics()["bleu"] < 100 and wait1.metrics()["al"] == pytest.approx(1.0)  # guessed the verb
    assert score_emissions(wait_k_emissions(sents, 3), sents).metrics()["bleu"] == pytest.approx(100)
    # silence insertion past the deadline costs quality too
    late = score_emissions(delayed_emissions(sents, [2, 2]), sents, delta=1)
    assert late.quality < delayed.quality and late.lag < delayed.lag


def test_split_sentences_by_periods():
    assert split_sentences(["a", ".", "b", ".", "c"], 2) == [[0, 1], [2, 3, 4]]
    assert split_sentences(["a", "b"], 2) == [[0, 1], []]


@pytest.mark.parametrize("expert,best_quality", [("delayed", True), ("oracle", True), ("wait-k", False)])
def test_env_episode_with_the_scripted_experts(expert, best_quality):
    env = make_env("simul", level=2, expert=expert, expert_k=1)
    assert isinstance(env, SimulEnv)
    obs, info = env.reset(seed=3)
    assert info["tools"] == [] and obs[-1].content == env.source[0]
    total, done, steps = 0.0, False, 0
    while not done:
        obs, reward, terminated, truncated, info = env.step(env.expert_action())
        assert sum(info["rewards"].values()) == pytest.approx(reward)
        total += reward
        done = terminated or truncated
        steps += 1
    assert terminated and steps == len(env.source)
    assert (info["bleu"] == pytest.approx(100)) == best_quality
    expected = {"delayed": delayed_emissions(env.sentences), "oracle": oracle_emissions(env.sentences),
                "wait-k": wait_k_emissions(env.sentences, 1)}[expert]
    sc = score_emissions(expected, env.sentences)
    assert total == pytest.approx(sc.quality + sc.lag)


def test_env_waiting_past_the_end_truncates_and_scores_nothing_written():
    env = SimulEnv(level=1, tail=2)
    env.reset(seed=0)
    for _ in range(5):
        obs, reward, terminated, truncated, info = env.step(AssistantMessage(content=""))
    assert obs[-1].content == "(end)" and not terminated
    obs, reward, terminated, truncated, info = env.step(AssistantMessage(content=""))
    assert truncated and info["bleu"] == 0.0 and info["rewards"]["quality"] == 0.0
    with pytest.raises(RuntimeError, match="over"):
        env.step(AssistantMessage(content="x"))


def test_delayed_sft_data_and_options():
    trajs = expert_trajectories("simul", range(3), level=2, expert="delayed", expert_extra_delay=1)
    for t in trajs:
        texts = [m.message.content for m in t.turns]
        assert texts.count("") >= 6 and sum(w == "." for x in texts for w in x.split()) == 2
        assert t.rewards["quality"] == pytest.approx(1.0)
    from closedloop.evals.envs.base import EnvOptionsError

    with pytest.raises(EnvOptionsError, match="lag_weight"):
        make_env("simul", lag_weight=-1)
