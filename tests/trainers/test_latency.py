"""The latency recipe's analytic baselines on the evaluation sentences, and its params (the GRPO run
itself is an experiment: ``closedloop recipe run latency``)."""

from __future__ import annotations

import pytest

from closedloop.trainers.latency import SimulTask, baselines
from closedloop.trainers.recipes import LATENCY, RecipeError, load_recipe, recipe_params


def test_baselines_trade_quality_for_lag():
    b = baselines(SimulTask(level=2, eval_episodes=30))
    for k in (1, 2, 3):
        assert b[f"wait-{k}"]["al"] == pytest.approx(k)  # AL of wait-k on equal lengths is k
    assert b["wait-1"]["bleu"] < 100 and b["wait-2"]["bleu"] == pytest.approx(100)  # the verb comes third
    assert b["delayed"]["bleu"] == pytest.approx(100) and b["delayed"]["al"] == pytest.approx(4)
    assert b["oracle"]["bleu"] == pytest.approx(100) and b["oracle"]["dal"] < b["wait-2"]["dal"]
    assert b["oracle"]["reward"] == max(v["reward"] for v in b.values())


def test_recipe_refuses_unknown_params_and_bad_values():
    recipe = load_recipe(LATENCY)
    with pytest.raises(RecipeError, match="unknown param.*grpo_step"):
        recipe_params(recipe, {"grpo_step": 3})
    with pytest.raises(RecipeError, match="grpo_steps"):
        recipe_params(recipe, {"grpo_steps": "many"})
    assert recipe_params(recipe, {"grpo_steps": 3}, quick=True)["sft_steps"] == recipe.quick["sft_steps"]
