"""The paper-effect recipes of issue 29 (``benchmarks/recipes/{ziprerank,ag_repa}.yaml``), run in
their ``--quick`` form end to end: they check the recipe (stages, counting, report, provenance),
not the effect, which needs the full run (``docs/results/<paper>/``)."""

from __future__ import annotations

import json
from pathlib import Path

from closedloop.trainers.recipes import run_recipe

RECIPES = Path(__file__).resolve().parents[2] / "benchmarks" / "recipes"


def _report(tmp_path: Path, name: str) -> dict:
    out = tmp_path / name
    run_recipe(RECIPES / f"{name}.yaml", quick=True, params={"out": str(out), "results_dir": str(out / "results")})
    result = json.loads((out / "results" / "results.json").read_text())
    assert (out / "results" / f"{name}.png").stat().st_size > 0
    table = (out / "results" / "results.md").read_text()
    state = json.loads((out / "recipe.json").read_text())["stages"]
    prov = result["provenance"]
    assert result["n_seeds"] == 2 and result["seeds"] == [0, 1]
    assert prov["seeds"] == {"seed-0": {"seed": 0}, "seed-1": {"seed": 1}}
    assert prov["stage_config_hashes"]["seed-1"] == state["seed-1"]["config_hash"]
    assert prov["commit"] == state["seed-0"]["commit"] and len(prov["config_hash"]) == 16
    assert prov["config_hash"] in table
    for arm in result["arms"].values():  # two seeds: every metric has a t interval around its mean
        for s in arm.values():
            assert len(s["per_seed"]) == 2 and s["low"] <= s["mean"] <= s["high"]
    assert sum(c["primary"] for c in result["comparisons"]) == 1
    assert all(c["holds"] in {"yes", "no", "unresolved"} for c in result["comparisons"])
    return result


def test_ziprerank_quick_recipe_counts_forwards_and_reports(tmp_path):
    result = _report(tmp_path, "ziprerank")
    arms = result["arms"]
    assert arms["sliding"]["forwards"]["per_seed"] == [7.0, 7.0]  # 1 + ceil((16 - 4) / 2) windows
    assert arms["single"]["forwards"]["per_seed"] == [1.0, 1.0]
    assert arms["first-stage"]["forwards"]["per_seed"] == [0.0, 0.0]
    # QI-EI keeps 4 of each page's 8 patches: 16 * 4 fewer input tokens per query.
    assert arms["single"]["tokens"]["mean"] - arms["single-qiei"]["tokens"]["mean"] == 16 * 4
    for arm in arms.values():
        assert all(0.0 <= v <= 1.0 for v in arm["ndcg@10"]["per_seed"])


def test_ag_repa_quick_recipe_selects_layers_with_fog_a_and_reports(tmp_path):
    result = _report(tmp_path, "ag_repa")
    for info in result["info"].values():
        assert len(info["fog_layers"]) == 3 and len(set(info["fog_layers"])) == 3
        assert info["fog_weights"] == sorted(info["fog_weights"], reverse=True)
        assert abs(sum(info["fog_weights"]) - 1.0) < 1e-9
        assert info["arm_layers"]["ag-repa"] == info["fog_layers"]
        assert info["arm_layers"]["none"] == [] and info["arm_layers"]["deep"] == [5, 6, 7]
    for arm in result["arms"].values():
        assert all(v > 0 for v in arm["fd"]["per_seed"])
    assert len(result["curves"]["layers"]["x"]) == 8
