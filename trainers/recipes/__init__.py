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

# Each constant's ``#:`` line is what ``closedloop plugins recipes`` shows without importing this
# package; it repeats the recipe file's ``description:`` (tests/newcomer/test_cli_help.py checks they agree).
#: the closed loop end to end: tiny model -> SFT -> GRPO -> held-out evaluation
DEMO = _HERE / "demo.yaml"
#: latency-aware GRPO on simul: SFT on delayed targets -> GRPO -> evaluation beside wait-k and the oracle
LATENCY = _HERE / "latency.yaml"
