"""Recipes: a multi-stage pipeline (build or load a model, SFT, GRPO, evaluate, compare, plot) as a
YAML file that one runner runs, with resume per stage (:mod:`.runner`; the format in :mod:`.spec`
and ``trainers/README.md``; the built-in stage kinds in :mod:`.stages`).

The built-in recipes are declared as entry points of group ``closedloop.recipes`` (pyproject.toml);
their objects are the recipe files below. ``closedloop recipe run NAME|FILE [--quick] [--set k=v]``.
"""

from __future__ import annotations

from pathlib import Path

from closedloop.trainers.recipes.runner import (ENTRY_POINT_GROUP, RecipeResult, StageContext, StageInterrupted,
                                                StageKind, available_recipes, load_recipe, recipe_params, run_recipe)
from closedloop.trainers.recipes.spec import Recipe, RecipeError

__all__ = ["DEMO", "LATENCY", "ENTRY_POINT_GROUP", "Recipe", "RecipeError", "RecipeResult", "StageContext",
           "StageInterrupted", "StageKind", "available_recipes", "load_recipe", "recipe_params", "run_recipe"]

_HERE = Path(__file__).resolve().parent

#: ``closedloop demo``: tiny model -> SFT on calc experts -> GRPO -> held-out evaluation, table and plot.
DEMO = _HERE / "demo.yaml"
#: Latency-aware GRPO on ``simul`` (paper 7): SFT on delayed targets -> GRPO -> evaluation beside baselines.
LATENCY = _HERE / "latency.yaml"
