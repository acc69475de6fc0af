"""Parity with tau2 itself on the golden fixtures computed by tau2 (``shared/anchors/tau2/golden``):
tool schemas byte for byte, every tool call's output, error flag and DB hash, and every
``reward_info`` of 222 trajectories under three reward bases. Skips when the fixtures are absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from closedloop.evals.tau import load_domain
from closedloop.evals.tau.data_model import RewardType, Task
from closedloop.evals.tau.evaluator import evaluate_tau2
from closedloop.evals.tau.results import from_tau2_message
from closedloop.evals.tau.simulation import SimulationRun, TerminationReason
from closedloop.messages import ToolCall

from ._support import ANCHORS

GOLDEN = ANCHORS / "tau2" / "golden" / "retail"
pytestmark = pytest.mark.skipif(not (GOLDEN / "tool_calls.json").is_file(), reason="tau2 golden fixtures not present")


def _load(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())


@pytest.fixture(scope="module")
def retail():
    return load_domain("retail", ANCHORS)


def test_tool_schemas_byte_equal(retail) -> None:
    gold = _load("tool_schemas.json")
    env = retail.make_environment()
    assert json.dumps([t.schema for t in env.tool_list]) == json.dumps(gold["tools"])
    assert {t.name: t.kind for t in env.tool_list} == gold["tool_types"]


def test_every_tool_call_output_error_and_hash(retail) -> None:
    gold = _load("tool_calls.json")
    assert retail.make_environment().db.tau2_hash() == gold["pristine_db_hash"]
    reads = {name for name, kind in _load("tool_schemas.json")["tool_types"].items() if kind == "read"}
    checked = 0
    for e, episode in enumerate(gold["episodes"]):
        env = retail.make_environment()
        assert env.db.tau2_hash() == episode["initial_db_hash"]
        for c, call in enumerate(episode["calls"]):
            msg = env.run_tool_call(ToolCall.make(call["name"], call["arguments"], id=f"c{c}"))
            where = (e, episode["kind"], c, call["name"])
            assert msg.text == call["output"], where
            assert (msg.error is not None) == call["error"], where
            if call["name"] not in reads:  # reads are covered by the next write's and the final hash
                assert env.db.tau2_hash() == call["db_hash"], where
            checked += 1
        assert env.db.tau2_hash() == episode["calls"][-1]["db_hash"], (e, episode["kind"])
    assert checked == gold["call_count"]


def _simulation(trajectory: dict) -> SimulationRun:
    return SimulationRun(task_id=trajectory["task_id"], termination_reason=TerminationReason.USER_STOP,
                         messages=[from_tau2_message(m) for m in trajectory["messages"]])


def _stub_judge(assertions: list[str]) -> list[dict]:
    return [{"nl_assertion": a, "met": True, "justification": "stub judge: all met"} for a in assertions]


def test_every_reward_info(retail) -> None:
    gold = _load("rewards.json")
    tasks = {t.id: t for t in retail.load_tasks("base").tasks}
    bases = {"task_basis": None, "db_communicate": [RewardType.DB, RewardType.COMMUNICATE],
             "action": [RewardType.ACTION]}
    for trajectory in gold["trajectories"]:
        task = tasks[trajectory["task_id"]]
        sim = _simulation(trajectory)
        for name, basis in bases.items():
            variant = task
            if basis is not None:
                variant = Task.model_validate(task.model_dump())
                variant.evaluation_criteria.reward_basis = basis
            ours = evaluate_tau2(sim, variant, retail.make_environment, nl_judge=_stub_judge)
            assert ours == trajectory["reward_info"][name], (trajectory["task_id"], trajectory["case"], name)
