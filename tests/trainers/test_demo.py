"""``closedloop demo --quick`` end to end, as CI runs the main job scaled down: every stage runs,
the table's numbers come from real held-out episodes, the plot and results exist, and every run
landed in the store; run again, every finished stage is skipped (the demo is a recipe)."""

from __future__ import annotations

import json

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
