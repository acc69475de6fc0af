"""``closedloop demo --quick`` end to end, as CI runs the main job scaled down: every stage runs,
the table's numbers come from real held-out episodes, the plot and results exist, and every run
landed in the store; run again, every finished stage is skipped (the demo is a recipe)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from closedloop.cli import main
from closedloop.store import RunStore

pytestmark = pytest.mark.slow


def test_demo_quick_runs_every_stage_and_records_everything(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "demo"
    args = ["demo", "--quick", "--model", f"hf:{tiny_model_path}", "--out", str(out), "--set", "eval_episodes=12",
            "--set", "grpo_steps=2"]
    rc = main(args)
    assert rc == 0
    printed = capsys.readouterr().out
    result = json.loads((out / "results.json").read_text())
    assert [s["name"] for s in result["stages"]] == ["base", "sft", "grpo"]
    for s in result["stages"]:
        m = s["summary"]
        assert m["episodes"] == 12
        assert m["ci_low"] <= m["success"] <= m["ci_high"]
        assert m["mean_turns"] >= 1 and m["mean_tokens"] > 0
        assert f"{m['success']:.3f}" in printed
    assert len(result["grpo_history"]) == 2
    png = out / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    store = RunStore(out / "runs.duckdb")
    kinds = {}
    for r in store.list_runs(limit=None):
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    assert kinds["expert"] == 120
    assert kinds["train"] == 2  # SFT and GRPO
    assert kinds["rollout"] == 2 * 4 * 4  # GRPO steps x prompts x generations
    assert kinds["eval"] == 3 and kinds["eval-episode"] == 3 * 12
    # the SFT and GRPO models are ordinary HF directories
    assert (out / "sft" / "config.json").exists() and (out / "grpo" / "config.json").exists()

    # Again: every stage finished before, so none runs (no new run in the store) and the table is the same.
    assert main(args) == 0
    again = capsys.readouterr().out
    for s in result["stages"]:
        assert f"{s['summary']['success']:.3f}" in again
    for stage in ("base", "experts", "sft", "grpo", "eval", "report"):
        assert f"{stage}: done before" in again
    assert len(store.list_runs(limit=None)) == sum(kinds.values())


def test_demo_rejects_unknown_settings(capsys):
    assert main(["demo", "--set", "nope=1"]) == 2
    assert "nope" in capsys.readouterr().out


def test_demo_seeds_quick_reports_each_seeds_demo_and_t_intervals_over_them(tiny_model_path, tmp_path):
    """``benchmarks/recipes/demo_seeds.yaml --quick``: one nested demo per seed (its own recipe.json
    with commit and seeds), and a report whose per-seed numbers are those demos' results.json and
    whose interval is the Student t one over them."""
    import statistics

    from scipy import stats

    from closedloop.trainers.recipes import run_recipe

    demo = {"model": f"hf:{tiny_model_path}", "expert_episodes": 8, "sft_steps": 1, "grpo_steps": 1,
            "prompts_per_step": 2, "num_generations": 2, "eval_episodes": 3}
    recipe = Path(__file__).resolve().parents[2] / "benchmarks" / "recipes" / "demo_seeds.yaml"
    done = run_recipe(recipe, quick=True, params={"out": str(tmp_path / "seeds"), "demo": demo})
    report = json.loads(Path(done.outputs["report"]["results"]).read_text())
    assert report["seeds"] == [0, 1] and report["episodes_per_stage"] == 3
    for stage in ("base", "sft", "grpo"):
        per_seed = [json.loads((tmp_path / "seeds" / f"seed-{s}" / "results.json").read_text())["stages"]
                    for s in (0, 1)]
        values = [next(x["summary"]["success"] for x in stages if x["name"] == stage) for stages in per_seed]
        row = report["stages"][stage]
        assert row["per_seed"] == values
        half = stats.t.ppf(0.975, 1) * statistics.stdev(values) / 2 ** 0.5
        assert row["ci_low"] == pytest.approx(statistics.fmean(values) - half)
    nested = json.loads((tmp_path / "seeds" / "seed-1" / "recipe.json").read_text())
    assert nested["params"]["seed"] == 1 and nested["stages"]["grpo"]["seeds"]["grpo.seed"] == 1
    assert report["commits"] == [nested["stages"]["grpo"]["commit"]]
    assert report["holds"] == all(s["ci_low"] > 0 for s in report["steps"].values())
    assert (tmp_path / "seeds" / "results.md").read_text().count("| seed 0 | seed 1 |") == 1
    assert (tmp_path / "seeds" / "demo_seeds.png").read_bytes()[:4] == b"\x89PNG"
