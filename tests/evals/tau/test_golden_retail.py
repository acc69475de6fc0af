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


def test_descriptions_from_a_tau2_checkout_replace_ours(tmp_path) -> None:
    """A checkout's docstrings win; the schemas stay tau2's shape (and equal to the golden file
    when the checkout's wording is the golden commit's)."""
    import shutil

    checkout = tmp_path / "tau2-bench"
    shutil.copytree(ANCHORS / "tau2", checkout / "data" / "tau2", ignore=shutil.ignore_patterns("golden"))
    src = checkout / "src" / "tau2" / "domains" / "retail"
    src.mkdir(parents=True)
    ours = Path(__file__).resolve().parents[3] / "evals" / "tau" / "domains" / "retail" / "tools.py"
    text = ours.read_text().replace("Calculate the result of a mathematical expression.",
                                    "Calculate the value of an arithmetic expression.")
    (src / "tools.py").write_text(text)
    data = load_domain("retail", checkout / "data")
    schemas = {t.name: t.schema for t in data.make_environment().tool_list}
    assert schemas["calculate"]["function"]["description"] == "Calculate the value of an arithmetic expression."
    gold = {t["function"]["name"]: t for t in _load("tool_schemas.json")["tools"]}
    assert {n: s for n, s in schemas.items() if n != "calculate"} == {n: s for n, s in gold.items() if n != "calculate"}
    fallback = load_domain("retail", checkout / "data", tau2_source=False)
    assert json.dumps([t.schema for t in fallback.make_environment().tool_list]) == json.dumps(_load("tool_schemas.json")["tools"])


def _run_episode(data, episode) -> tuple[list[str], str]:
    env = data.make_environment()
    outputs = [env.run_tool_call(ToolCall.make(c["name"], c["arguments"], id=f"c{i}")).text
               for i, c in enumerate(episode["calls"])]
    return outputs, env.get_db_hash()


def test_options_change_what_tau2_gets_wrong_and_nothing_by_default() -> None:
    gold = _load("tool_calls.json")["episodes"]
    fixed = load_domain("retail", ANCHORS, options={"per_item_swap_prices": True, "accent_insensitive_lookup": True,
                                                     "json_string_args": True})
    default = load_domain("retail", ANCHORS)
    for n in (2, 3):
        given = [e for e in gold if e["kind"] == f"multi_item_modify_{n}_pairs_given"]
        reverse = [e for e in gold if e["kind"] == f"multi_item_modify_{n}_pairs_reversed"]
        for a, b in zip(given, reverse):
            assert _run_episode(default, a)[1] != _run_episode(default, b)[1]  # tau2: order matters
            assert _run_episode(fixed, a)[1] == _run_episode(fixed, b)[1]      # option: it does not
    names = next(e for e in gold if e["kind"] == "name_email_variants")
    default_out, _ = _run_episode(default, names)
    fixed_out, _ = _run_episode(fixed, names)
    assert sum(o == "User not found" or o == "Error: User not found" for o in fixed_out) < \
        sum(o == "Error: User not found" for o in default_out)
    strings = next(e for e in gold if e["kind"] == "json_string_lists")
    fixed_out, _ = _run_episode(fixed, strings)
    assert not any(o.startswith("Error: [ not found") or o.startswith("Error: Number of [") for o in fixed_out)
