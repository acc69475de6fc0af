"""The recipe runner: params, expressions, when/foreach, resume per stage (a finished stage is
skipped, a changed one re-runs with everything after it), failure and Ctrl-C records, the CLI, and
that every recipe in the repository loads with stage kinds that resolve.

The stages here are real stage kinds loaded from a real ``kinds.py`` beside the recipe file (the
``file.py:attr`` form); each appends its name to ``calls.txt``, so which stages ran is read from
disk, not from the runner's own report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from closedloop.cli import main
from closedloop.trainers.recipes import RecipeError, load_recipe, run_recipe
from closedloop.trainers.recipes.runner import _stage_kind

KINDS = '''
from pathlib import Path
from typing import Any
from pydantic import BaseModel, ConfigDict
from closedloop.trainers.recipes import StageInterrupted, StageKind

class Add(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: int
    b: int = 0
    seed: int = 0
    fail: bool = False
    interrupt: bool = False

def _add(cfg: Add, ctx) -> dict[str, Any]:
    with open(ctx.out / "calls.txt", "a") as f:
        f.write(ctx.name + "\\n")
    if cfg.fail:
        raise RuntimeError("boom")
    if cfg.interrupt:
        raise StageInterrupted("saved checkpoint-3")
    (ctx.dir / "sum.txt").write_text(str(cfg.a + cfg.b))
    return {"sum": cfg.a + cfg.b}

ADD = StageKind(Add, _add, "a + b")
'''

RECIPE = '''
name: toy
description: a toy pipeline
params:
  x: {default: 1, help: the first number}
  y: 2
  n: 2
  fail: false
  interrupt: false
quick: {x: 10}
vars: {double: "${x * 2}"}
out: ${out_dir}/run
stages:
  - {name: one, kind: kinds.py:ADD, config: {a: "${x}", b: "${double}", seed: 7}}
  - {name: two, kind: kinds.py:ADD, config: {a: "${stages.one.sum}", b: "${y}", fail: "${fail}", interrupt: "${interrupt}"}}
  - {name: "sq-${item}", kind: kinds.py:ADD, foreach: "${range(n) | list}", config: {a: "${item}", b: "${stages.two.sum}"}}
  - {name: never, kind: kinds.py:ADD, when: "${x > 100}", config: {a: 0}}
'''


@pytest.fixture
def recipe(tmp_path):
    (tmp_path / "kinds.py").write_text(KINDS)
    path = tmp_path / "toy.yaml"
    path.write_text(RECIPE.replace("${out_dir}", str(tmp_path)))
    return path


def _calls(out: Path) -> list[str]:
    path = out / "calls.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return lines


def test_stages_run_in_order_with_params_vars_foreach_and_when(recipe, tmp_path):
    result = run_recipe(recipe)
    out = tmp_path / "run"
    assert _calls(out) == ["one", "two", "sq-0", "sq-1"]  # `never` is left out
    assert result.outputs == {"one": {"sum": 3}, "two": {"sum": 5}, "sq-0": {"sum": 5}, "sq-1": {"sum": 6}}
    assert (out / "sq-1" / "sum.txt").read_text() == "6"  # each stage has its folder
    record = json.loads((out / "recipe.json").read_text())["stages"]["one"]
    assert record["status"] == "completed" and record["config"] == {"a": 1, "b": 2, "seed": 7}
    assert record["seeds"] == {"seed": 7} and record["outputs"] == {"sum": 3}
    assert "commit" in record and record["seconds"] >= 0
    log = (out / "recipe.log").read_text()
    assert "one: kinds.py:ADD" in log and "never: left out" in log

    quick = run_recipe(recipe, quick=True, params={"y": 0})
    assert quick.outputs["one"] == {"sum": 30} and quick.outputs["two"] == {"sum": 30}


def test_a_rerun_skips_finished_stages_and_reruns_from_the_first_change(recipe, tmp_path):
    out = tmp_path / "run"
    run_recipe(recipe)
    _calls(out)
    again = run_recipe(recipe)
    assert _calls(out) == [] and again.skipped == ["one", "two", "sq-0", "sq-1"]
    assert again.outputs["sq-1"] == {"sum": 6}  # outputs of skipped stages come from the records

    changed = run_recipe(recipe, params={"y": 5})  # stage two's config changes: it and everything after re-run
    assert _calls(out) == ["two", "sq-0", "sq-1"] and changed.outputs["sq-1"] == {"sum": 9}
    run_recipe(recipe, params={"y": 5}, from_stage="sq-0")
    assert _calls(out) == ["sq-0", "sq-1"]
    run_recipe(recipe, params={"y": 5}, stage_overrides={"one": {"seed": 8}})  # --set one.seed=8
    assert _calls(out) == ["one", "two", "sq-0", "sq-1"]


def test_failed_and_interrupted_stages_are_recorded_and_resumed(recipe, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="boom"):
        run_recipe(recipe, params={"fail": True})
    state = json.loads((out / "recipe.json").read_text())["stages"]
    assert state["one"]["status"] == "completed"
    assert state["two"]["status"] == "failed" and "boom" in state["two"]["error"]
    assert _calls(out) == ["one", "two"]

    stopped = run_recipe(recipe, params={"interrupt": True})
    assert stopped.interrupted and _calls(out) == ["two"]
    assert json.loads((out / "recipe.json").read_text())["stages"]["two"]["status"] == "interrupted"

    done = run_recipe(recipe)
    assert done.status == "completed" and _calls(out) == ["two", "sq-0", "sq-1"]  # `one` stays done


def test_bad_input_is_one_clear_error(recipe, tmp_path, capsys):
    with pytest.raises(RecipeError, match=r"unknown param\(s\) \['z'\]; valid: x, y, n"):
        run_recipe(recipe, params={"z": 1})
    with pytest.raises(RecipeError, match="x: Input should be a valid integer"):
        run_recipe(recipe, params={"x": "many"})
    with pytest.raises(RecipeError, match=r"stage one \(kinds.py:ADD\): c: Extra inputs are not permitted"):
        run_recipe(recipe, stage_overrides={"one": {"c": 1}})
    with pytest.raises(RecipeError, match="undefined"):
        run_recipe(load_recipe(recipe).model_copy(update={"vars": {"double": "${nope * 2}"}}))
    assert main(["recipe", "run", str(recipe), "--set", "z=1"]) == 2
    assert "unknown param" in capsys.readouterr().err
    assert main(["recipe", "run", str(tmp_path / "missing.yaml")]) == 2


def test_cli_runs_lists_keys_and_exits_130_on_an_interrupted_stage(recipe, tmp_path, capsys):
    assert main(["recipe", "run", str(recipe), "--list-keys"]) == 0
    assert "x (1, quick: 10): the first number" in capsys.readouterr().out
    assert main(["recipe", "run", str(recipe), "--set", "y=3", "--set", "one.seed=9"]) == 0
    assert "done: ran one, two, sq-0, sq-1" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "recipe.json").read_text())["stages"]["one"]["config"]["seed"] == 9
    assert main(["recipe", "run", str(recipe), "--set", "interrupt=true", "--set", "one.seed=9", "--set", "y=3"]) == 130


def _all_recipes() -> list[Path]:
    root = Path(__file__).resolve().parents[2]
    return sorted((root / "trainers" / "recipes").glob("*.yaml")) + sorted((root / "benchmarks" / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", _all_recipes(), ids=lambda p: p.stem)
def test_every_recipe_in_the_repository_loads_and_its_stage_kinds_resolve(path):
    from closedloop.trainers.recipes import recipe_params

    recipe = load_recipe(path)
    assert recipe.description and recipe.params
    recipe_params(recipe)
    recipe_params(recipe, quick=True)
    for stage in recipe.stages:
        kind = _stage_kind(stage.kind, recipe)
        assert kind.config_class.model_fields


def test_the_builtin_recipes_are_entry_points():
    from closedloop.trainers.recipes import DEMO, LATENCY, available_recipes

    from closedloop import plugins

    found = available_recipes()
    assert {"demo", "latency"} <= set(found)
    assert found["demo"].target == "closedloop.trainers.recipes:DEMO"
    recipes = plugins.registry("recipes")
    assert recipes.load("demo") == DEMO and recipes.load("latency") == LATENCY
    assert load_recipe("latency").name == "latency"
