"""``--export`` as tau2 reads it, and tau2's own results read back (pass^k over tau2's runs).

The export is checked against what tau2's ``Results`` loader requires (``results_schema_notes.md``
in the golden folder; a test below restates it field by field), and, where a Python with tau2
importable is named by ``TAU2_PYTHON``, loaded for real with ``Results.load`` and tau2's
``compute_metrics``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from closedloop.evals.tau import load_domain
from closedloop.evals.tau.conventions import Conventions
from closedloop.evals.tau.metrics import compute_metrics, results_metrics
from closedloop.evals.tau.results import load_tau2_results
from closedloop.evals.tau.runner import EvalSettings, TauRunner, export_results
from closedloop.evals.tau.agents import make_agent_factory

from ._support import ANCHORS
from .test_context_overflow import StopUser

GOLDEN = ANCHORS / "tau2" / "golden" / "retail"
TERMINATIONS = {"user_stop", "agent_stop", "max_steps", "timeout", "too_many_errors", "agent_error", "user_error",
                "infrastructure_error", "context_window_exceeded", "unexpected_error"}


def check_tau2_results(data: dict) -> None:
    """What tau2's ``Results.model_validate_json`` requires (results_schema_notes.md)."""
    info = data["info"]
    assert isinstance(info["git_commit"], str)
    for key in ("num_trials", "max_steps", "max_errors"):
        assert isinstance(info[key], int), key
    assert isinstance(info["user_info"]["implementation"], str)
    assert isinstance(info["agent_info"]["implementation"], str)
    assert isinstance(info["environment_info"]["domain_name"], str)
    assert isinstance(info["environment_info"]["policy"], str)
    for task in data["tasks"]:
        assert isinstance(task["id"], str) and task["user_scenario"]["instructions"]
    task_ids = {t["id"] for t in data["tasks"]}
    for sim in data.get("simulations", []):
        for key in ("id", "task_id", "start_time", "end_time"):
            assert isinstance(sim[key], str), key
        assert sim["task_id"] in task_ids  # else tau2's compute_metrics raises StopIteration
        assert isinstance(sim["duration"], float) and sim["termination_reason"] in TERMINATIONS
        ri = sim.get("reward_info")
        assert ri is None or isinstance(ri["reward"], float)  # never reward: null
        if ri is not None:
            assert set(ri) <= {"reward", "db_check", "env_assertions", "action_checks", "nl_assertions",
                               "communicate_checks", "reward_basis", "reward_breakdown", "info"}
        assert sim.get("agent_usage") is None  # tau2's field has another type; ours is renamed
        for m in sim.get("messages", []):
            assert m["role"] in {"assistant", "user", "tool", "system"}
            if m["role"] == "tool":
                assert isinstance(m["id"], str) and isinstance(m["error"], bool)
                assert m["requestor"] in {"assistant", "user"}
            for call in m.get("tool_calls") or []:
                assert set(call) == {"id", "name", "arguments", "requestor"} and isinstance(call["arguments"], dict)


@pytest.fixture
def export(mini_root: Path, tmp_path: Path) -> Path:
    from closedloop.store import RunStore
    import asyncio

    store = RunStore(tmp_path / "runs.duckdb")
    data = load_domain("retail", mini_root)
    taskset = data.load_tasks("base")
    settings = EvalSettings(name="x", domain="retail", split="base", data_dir=str(mini_root),
                            task_file_sha256=taskset.sha256, agent="oracle", trials=2)
    oracle = make_agent_factory("oracle")
    asyncio.run(TauRunner(settings, taskset.tasks, data, store, agents=lambda t: oracle,
                          user_for=lambda task: StopUser()).run())
    out = tmp_path / "results.json"
    export_results(store, "x", taskset.tasks, str(out))
    return out


def test_export_meets_tau2_loader_requirements(export: Path) -> None:
    data = json.loads(export.read_text())
    check_tau2_results(data)
    assert data["info"]["environment_info"]["policy"] == load_domain("retail", Path(data["info"]["data_dir"])).policy
    # the task judged by NL assertions has no judge here: tau2's record is null, ours says why
    ungraded = [s for s in data["simulations"] if s["reward_info"] is None]
    assert ungraded and all("NL_ASSERTION" in s["closedloop_reward_info"]["not_graded"] for s in ungraded)


def test_export_reads_back_with_the_same_metrics(export: Path) -> None:
    sims, tasks, info = load_tau2_results(export)
    assert info["environment_info"]["domain_name"] == "retail" and len(sims) == 8
    assert info["conventions"] == {"gold_sync": False, "ungraded": "fail", "pass_k": "capped"}  # tau2's
    again = compute_metrics(sims, ks=range(1, info["num_trials"] + 1))
    assert again.pass_hat_k == {1: 0.75, 2: 0.75} and len(again.ungraded) == 2  # the unjudged task fails
    ours = compute_metrics(sims, conventions=Conventions(ungraded="exclude"))
    assert ours.pass_hat_k == {1: 1.0, 2: 1.0}


@pytest.mark.skipif(not (GOLDEN / "results_tau2.json").is_file(), reason="tau2 golden fixtures not present")
def test_import_tau2s_own_results_file() -> None:
    sims, tasks, info = load_tau2_results(GOLDEN / "results_tau2.json")
    assert sorted(s.task_id for s in sims) == ["0", "105", "19", "34"] and len(tasks) == 4
    assert all(s.reward_info.reward == 1.0 for s in sims)
    assert sims[0].reward_info.to_tau2() == json.loads((GOLDEN / "results_tau2.json").read_text())["simulations"][0]["reward_info"]
    m = compute_metrics(sims)
    assert m.pass_hat_k == {1: 1.0} and m.num_tasks[1] == 4
    check_tau2_results(json.loads((GOLDEN / "results_tau2.json").read_text()))  # the checker accepts tau2's file


def test_bad_results_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"simulations": []}))
    with pytest.raises(ValueError, match="not a tau2 results file"):
        load_tau2_results(bad)


TAU2_PYTHON = os.environ.get("TAU2_PYTHON")


@pytest.mark.skipif(not TAU2_PYTHON, reason="set TAU2_PYTHON to a Python that can import tau2")
def test_real_tau2_loads_the_export(export: Path) -> None:
    script = ("import sys, json; from tau2.data_model.simulation import Results; "
              "from tau2.metrics.agent_metrics import compute_metrics; r = Results.load(sys.argv[1]); "
              "m = compute_metrics(r); print(json.dumps([len(r.simulations), m.pass_hat_ks, m.avg_reward]))")
    out = subprocess.run([TAU2_PYTHON, "-c", script, str(export)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    n, pass_hat_ks, avg_reward = json.loads(out.stdout.strip().splitlines()[-1])
    assert n == 8
    sims, _, info = load_tau2_results(export)  # with ungraded episodes: our default is tau2's figure
    ours = results_metrics(sims, info)
    assert {str(k): v for k, v in ours.pass_hat_k.items()} == pytest.approx(pass_hat_ks) and ours.avg_reward == avg_reward


def test_cli_import_prints_pass_k(export: Path, capsys) -> None:
    from closedloop.cli import main

    assert main(["eval", "tau", "import", str(export)]) == 0
    out = capsys.readouterr().out
    assert "pass^1" in out and "pass^2" in out and "ungraded" in out
    assert main(["eval", "tau", "import", str(export.parent / "missing.json")]) == 2
