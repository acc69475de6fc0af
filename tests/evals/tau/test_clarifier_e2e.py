"""Offline end to end: the clarifier graph as the agent, the tiny model behind the hf: backend, on a
clarification-enhanced retail task (the small data root built in _support: the real retail policy
and schemas exceed the tiny model's context), through the CLI. Scores near 0 are expected from a
150k-parameter model; the mechanics are what is checked."""

from __future__ import annotations

import json

import pytest

from closedloop.cli import main
from closedloop.evals.tau.simulation import TerminationReason
from closedloop.store import RunStore

pytestmark = pytest.mark.slow
GRADED = {TerminationReason.USER_STOP.value, TerminationReason.AGENT_STOP.value,
          TerminationReason.MAX_STEPS.value, TerminationReason.TOO_MANY_ERRORS.value}


def _eval(tmp_path, root, tiny_model_path, user: str) -> tuple[dict, RunStore]:
    db, out = tmp_path / f"{user}.duckdb", tmp_path / f"{user}.json"
    rc = main(["eval", "tau", "--domain", "retail", "--split", "train", "--task-ids", "cancel", "--data-dir", str(root),
               "--agent", "clarifier", "--clarify", "--model", f"hf:{tiny_model_path}",
               "--user-model", f"hf:{tiny_model_path}" if user == "tiny" else "scenario",
               "--user-temperature", "1.0", "--max-steps", "6", "--max-tokens", "32",
               "--store", str(db), "--export", str(out), "--concurrency", "1"])
    assert rc == 0
    [sim] = json.loads(out.read_text())["simulations"]
    return sim, RunStore(db)


def test_clarifier_agent_with_the_tiny_model_on_a_clarified_task(mini_root, tiny_model_path, tmp_path):
    sim, store = _eval(tmp_path, mini_root, tiny_model_path, "scenario")
    assert "[clarify:" in sim["task_id"] and sim["termination_reason"] in GRADED
    [parent] = store.list_runs(kind="eval")
    assert parent.status == "completed" and parent.graph == "clarifier"
    [episode] = store.list_runs(parent_id=parent.id)
    run = store.get_run(episode.id)
    assert run.turns
    assert all(t.completion_ids is None or len(t.logprobs) == len(t.completion_ids) for t in run.turns)


def test_tiny_model_as_user_simulator_is_wired_through_the_hf_backend(mini_root, tiny_model_path, tmp_path):
    """The tiny user either plays along or fails in a way that is reported as the user simulator's
    (an infrastructure error, not an agent failure): never a crash of the harness."""
    sim, _ = _eval(tmp_path, mini_root, tiny_model_path, "tiny")
    if sim["termination_reason"] == TerminationReason.INFRASTRUCTURE_ERROR.value:
        assert "user simulator" in (sim.get("error") or json.dumps(sim))
    else:
        assert sim["termination_reason"] in GRADED
        assert any(m["role"] == "user" for m in sim["messages"])
