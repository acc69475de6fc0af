"""Summaries never mislead (issue 30, friction 6): no metric over nothing answered or graded, τ's
graded / ungraded-with-reason / DB-match counts, and a non-zero exit when infrastructure errors
make the numbers meaningless. Real evaluations: the shipped helpdesk τ domain and FactGuard's
synthetic data, with model backends registered in-process (one that never answers, one whose
server is down)."""

from __future__ import annotations

import json

import pytest

from closedloop import plugins
from closedloop.cli import main
from closedloop.messages import AssistantMessage, Turn, Usage
from closedloop.models.base import ModelClient, ModelUnavailableError
from closedloop.store import RunStore


class Silent(ModelClient):
    """Answers every request with an empty message: nothing is ever answered."""

    spec = "silent:test"

    async def generate(self, messages, tools=None, params=None, tool_choice=None) -> Turn:
        return Turn(message=AssistantMessage(content=""), model=self.spec, usage=Usage(), finish_reason="stop")


class Down(ModelClient):
    """A model server that cannot be reached."""

    spec = "down:test"

    async def generate(self, messages, tools=None, params=None, tool_choice=None) -> Turn:
        raise ModelUnavailableError("cannot reach the model server at http://127.0.0.1:9/v1")


plugins.registry("backends").register("silent", lambda spec, **kw: Silent(), replace=True)
plugins.registry("backends").register("down", lambda spec, **kw: Down(), replace=True)


def test_tau_summary_counts_graded_ungraded_and_db_matches(tmp_path, capsys):
    store = tmp_path / "runs.duckdb"
    assert main(["eval", "tau", "--domain", "helpdesk", "--agent", "oracle", "--store", str(store),
                 "--name", "gold"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "graded │ 12 episodes (avg reward 1.000)" in out
    assert "DB match │ 12 of 12 episodes whose DB was checked" in out and "ungraded │ 0" in out


def test_tau_with_nothing_graded_shows_no_metric_and_exits_1(tmp_path, capsys):
    rc = main(["eval", "tau", "--domain", "helpdesk", "--split", "test", "--agent", "react", "--model", "down:x",
               "--user-model", "scenario", "--store", str(tmp_path / "runs.duckdb"), "--export", str(tmp_path / "r.json")])
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())
    assert rc == 1
    assert "no metric: nothing was graded" in out and "pass^1" not in out and "avg reward" not in out
    assert "4 of 4 episodes (100%) ended in infrastructure errors" in captured.err
    sims = json.loads((tmp_path / "r.json").read_text())["simulations"]  # the export says what it holds
    assert {s["termination_reason"] for s in sims} == {"infrastructure_error"}
    assert "exported 4 simulations" in out


def test_tau_infra_errors_under_the_threshold_do_not_fail(tmp_path):
    assert main(["eval", "tau", "--domain", "helpdesk", "--split", "test", "--agent", "react", "--model", "down:x",
                 "--user-model", "scenario", "--store", str(tmp_path / "runs.duckdb"), "--max-infra-errors", "1"]) == 0


@pytest.fixture(scope="module")
def factguard_data(tmp_path_factory):
    from closedloop.evals.factguard.synthetic import make_synthetic

    data = tmp_path_factory.mktemp("fg") / "fg"
    make_synthetic(data, n=12)
    return data


def test_factguard_with_nothing_answered_prints_no_metrics_and_stores_none(factguard_data, tmp_path, capsys):
    store = tmp_path / "runs.duckdb"
    rc = main(["eval", "factguard", "--data", str(factguard_data), "--split", "all", "--model", "silent:x",
               "--store", str(store), "--limit", "4"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0
    assert "nothing answered: 4 of 4 samples have no verdict" in out and "answered │ 0 of 4" in out
    assert "1.000" not in out  # the old summary: accuracy 1.000 over four unanswered samples
    [parent] = RunStore(store).list_runs(limit=None, kind="eval")
    assert "metrics" not in parent.outcome and parent.outcome["answered"] == 0


def test_factguard_with_every_sample_failing_exits_1(factguard_data, tmp_path, capsys):
    rc = main(["eval", "factguard", "--data", str(factguard_data), "--split", "all", "--model", "down:x",
               "--store", str(tmp_path / "runs.duckdb"), "--limit", "3"])
    assert rc == 1
    assert "3 of 3 episodes (100%) ended in infrastructure errors" in capsys.readouterr().out


def test_kernelbench_without_an_agent_or_anything_graded_claims_nothing(tmp_path, capsys):
    """Candidate files that are not there: the failures are the candidates' (there is no agent),
    no fast_p over nothing graded, and neither the export nor the plot claims a file."""
    from closedloop.samples import sample_path

    (tmp_path / "empty").mkdir()
    export, plot = tmp_path / "out" / "eval_results.json", tmp_path / "out" / "speedups.png"
    assert main(["eval", "kernelbench", "--problems", str(sample_path("kernelbench")), "--level", "1",
                 "--candidates", str(tmp_path / "empty"), "--store", str(tmp_path / "runs.duckdb"),
                 "--export", str(export), "--plot", str(plot)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "candidate file error: 3" in out and "agent_error" not in out
    assert "fast_p │ - (nothing graded)" in out and "fast_0=" not in out
    assert "export: nothing written" in out and "plot: nothing written" in out and "exported" not in out
    assert not export.exists() and not plot.exists()
