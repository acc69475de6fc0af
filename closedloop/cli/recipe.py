"""``closedloop recipe run FILE|NAME [--quick] [--set NAME=VALUE ...]`` and ``closedloop recipe list``.

A recipe is a multi-stage pipeline in YAML (``trainers/README.md``, "Recipes"); NAME is a recipe
declared as an entry point of group ``closedloop.recipes`` (``closedloop recipe list``). A finished
stage is skipped when the recipe is run again (``--from STAGE`` re-runs from there). Exit codes: 2
for bad input (unknown recipe or param, a stage config that does not validate), 130 when a Ctrl-C
stopped a stage after saving its checkpoint. Nothing under ``closedloop.trainers`` is imported
until the command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipe", help="run a multi-stage pipeline (build, SFT, GRPO, evaluate, ...) from YAML",
                       description="Run a recipe: stages that build or load a model, train and evaluate it, each "
                                   "skipped on a re-run once finished.")
    actions = p.add_subparsers(dest="recipe_command", required=True)
    run = actions.add_parser("run", help="run a recipe file or a named recipe")
    add_run_arguments(run, with_recipe=True)
    run.set_defaults(func=handle_run)
    listing = actions.add_parser("list", help="the named recipes (entry points of group closedloop.recipes)")
    listing.set_defaults(func=handle_list)


def add_run_arguments(p: argparse.ArgumentParser, *, with_recipe: bool) -> None:
    """The options of ``recipe run`` (``closedloop demo`` has them too, for its built-in recipe)."""
    if with_recipe:
        p.add_argument("recipe", help="a recipe YAML file, or the name of an installed recipe (closedloop recipe list)")
    p.add_argument("--quick", action="store_true", help="the recipe's scaled-down settings (its `quick:` params)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="NAME=VALUE",
                   help="a param (--list-keys), or STAGE.KEY=VALUE for a key of a stage's config; values are YAML; "
                        "repeatable")
    p.add_argument("--from", dest="from_stage", default=None, metavar="STAGE",
                   help="run this stage and the ones after it again, even if they finished")
    p.add_argument("--list-keys", action="store_true", help="list the recipe's params with defaults and exit")


def _stderr(text: str) -> None:
    print(text, file=sys.stderr)


def run_from_args(ref: Any, args: argparse.Namespace, params: dict[str, Any] | None = None, *, console: Any = None,
                  error: Callable[[str], None] = _stderr) -> int | Any:
    """Run ``ref`` with the parsed options (``params`` before ``--set``); an exit code, or the
    :class:`~closedloop.trainers.recipes.RecipeResult` when it ran. ``error`` shows a bad-input line."""
    from closedloop.terminal import make_console

    from closedloop.trainers.common import TrainingDivergedError
    from closedloop.trainers.recipes import load_recipe, run_recipe
    from closedloop.trainers.recipes.runner import split_overrides

    console = console or make_console()
    try:
        recipe = load_recipe(ref)
        if args.list_keys:
            for name, spec in recipe.params.items():
                quick = f", quick: {recipe.quick[name]!r}" if name in recipe.quick else ""
                console.print(f"[bold]{name}[/bold] ({spec.default!r}{quick}): {spec.help}", highlight=False)
            return 0
        values, stage_overrides = split_overrides(args.overrides, recipe)
        result = run_recipe(recipe, params={**(params or {}), **values}, quick=args.quick,
                            stage_overrides=stage_overrides, from_stage=args.from_stage, console=console)
    except (ValueError, FileNotFoundError) as e:  # a bad recipe, param, stage config or dataset (RecipeError, ...)
        error(f"error: {e}")
        return 2
    except TrainingDivergedError as e:
        error(f"error: {e}")
        return 1
    if result.interrupted:
        error(f"interrupted; run it again to continue ({result.out / 'recipe.json'})")
        return 130
    return result


def handle_run(args: argparse.Namespace) -> int:
    result = run_from_args(args.recipe, args)
    if isinstance(result, int):
        return result
    print(f"done: ran {', '.join(result.ran) or 'nothing'}"
          f"{'; skipped ' + ', '.join(result.skipped) if result.skipped else ''}; {result.out}/recipe.json")
    return 0


def handle_list(args: argparse.Namespace) -> int:
    from closedloop.trainers.recipes import available_recipes, load_recipe

    for name, ep in sorted(available_recipes().items()):
        try:
            description = load_recipe(name).description
        except Exception as e:  # a broken plugin is listed with the reason, not fatal to the listing
            description = f"(cannot load: {e})"
        print(f"{name}\t{description}\t({ep.target})")
    return 0
