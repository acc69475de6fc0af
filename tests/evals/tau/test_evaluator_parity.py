"""The evaluator path against real tau2, on data computed by tau2 itself (``fixtures/``):

- ``reward_info`` of a gold trajectory field for field (``expected.json``, the fixture tasks of
  every domain; on telecom two train tasks whose user surroundings change on sync), and as a
  digest for every train task of retail, airline and telecom (``evaluator_train.json``, run when
  the full data is present: ``TAU2_DATA_DIR``, or the retail anchors), under the task's basis
  and under all criteria, with tau2's gold replay state (``make_tool_call``, no ``sync_tools``);
- tool outputs for calls whose arguments are named like tau2's dispatcher parameters;
- the metrics of results files with ungraded episodes and unequal trials, as tau2's
  ``compute_metrics`` gives them.

The gold trajectory and the digests are defined once, in ``fixtures/tau2_evaluator.py``, for
both interpreters. The NL judge is a stub on both sides (every assertion met)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from closedloop.evals.tau import load_domain
from closedloop.evals.tau.data import DomainData
from closedloop.evals.tau.data_model import RewardType, Task
from closedloop.evals.tau.evaluator import evaluate_tau2
from closedloop.evals.tau.evaluator.db_check import replay_gold
from closedloop.evals.tau.metrics import results_metrics
from closedloop.evals.tau.results import RunInfo, load_tau2_results, tau2_message, write_results
from closedloop.evals.tau.simulation import RewardInfo, SimulationRun, TerminationReason
from closedloop.evals.tau.user_messages import TauUserMessage, requestors
from closedloop.messages import AssistantMessage, ToolCall, UserMessage

from ._support import ANCHORS

FIXTURES = Path(__file__).parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
TRAIN = json.loads((FIXTURES / "evaluator_train.json").read_text())
DOMAINS = ("retail", "airline", "telecom")


def _fixture_script(name: str) -> Any:
    """A fixture script as a module (their top level imports only the standard library)."""
    spec = importlib.util.spec_from_file_location(name, FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


RECIPE = _fixture_script("tau2_evaluator")  # the trajectory and digests tau2's side used


def gold_simulation(data: DomainData, task: Task) -> SimulationRun:
    """The gold trajectory of ``tau2_evaluator.gold_trajectory``, its tool results from our
    environment's live calls."""
    env = data.make_environment()
    env.apply_initial_state(task.initial_state)
    instructions = task.user_scenario.instructions
    messages: list = [AssistantMessage(content=RECIPE.GREETING),
                      UserMessage(content=getattr(instructions, "reason_for_call", str(instructions)))]
    for i, action in enumerate(task.evaluation_criteria.actions or []):
        call = ToolCall.make(action.name, action.arguments, id=f"call_{i}")
        sender = TauUserMessage if action.requestor == "user" else AssistantMessage
        messages.append(sender(content=None, tool_calls=[call]))
        messages.append(env.run_tool_call(call, action.requestor))
    messages.append(AssistantMessage(content=RECIPE.closing_text(task.evaluation_criteria.communicate_info)))
    messages.append(UserMessage(content="###STOP###"))
    return SimulationRun(task_id=task.id, termination_reason=TerminationReason.USER_STOP, messages=messages)


def trajectory_digest(sim: SimulationRun) -> str:
    who = requestors(sim.messages)
    return RECIPE.digest(RECIPE.canonical_messages([tau2_message(m, i, who) for i, m in enumerate(sim.messages)]))


def stub_judge(assertions: list[str]) -> list[dict]:
    return [{"nl_assertion": a, "met": True, "justification": RECIPE.STUB_JUSTIFICATION} for a in assertions]


def all_criteria(task: Task) -> Task:
    variant = Task.model_validate(task.model_dump())
    variant.evaluation_criteria.reward_basis = [RewardType(b) for b in RECIPE.ALL_CRITERIA]
    return variant


def gold_state(data: DomainData, task: Task, *, gold_sync: bool = False) -> dict[str, str | None]:
    """Our gold replay, as the evaluator runs it, in tau2's hash (first 16 hex digits)."""
    env = data.make_environment()
    env.apply_initial_state(task.initial_state)
    replay_gold(env, task, sync=gold_sync)
    user = env.user_db.tau2_hash() if env.user_db is not None else None
    return {"db_hash": RECIPE.short(env.db.tau2_hash()), "user_db_hash": RECIPE.short(user)}


def compare(data: DomainData, task: Task, want: dict, *, full: bool) -> list[str]:
    """What differs from tau2's record of the task (empty: nothing)."""
    sim = gold_simulation(data, task)
    ours = evaluate_tau2(sim, task, data.make_environment, nl_judge=stub_judge)
    every = evaluate_tau2(sim, all_criteria(task), data.make_environment, nl_judge=stub_judge)
    tau2_own = want["reward_info"]["task_basis"]
    problems = []
    if trajectory_digest(sim) != want["trajectory_digest"]:
        problems.append("trajectory")
    if ours != tau2_own if full else RECIPE.digest(ours) != tau2_own:
        problems.append(f"reward_info (tau2: reward {want['reward']}, db_match {want['db_match']}) "
                        f"{json.dumps(ours)[:600]}")
    if RECIPE.digest(every) != want["reward_info"]["all_criteria"]:
        problems.append(f"all-criteria reward_info {json.dumps(every)[:600]}")
    if gold_state(data, task) != want["gold"]:
        problems.append("gold state")
    return problems


@pytest.mark.parametrize("domain", DOMAINS)
def test_reward_info_equals_tau2s_field_for_field_on_the_fixture_tasks(domain: str) -> None:
    data = load_domain(domain, FIXTURES, tau2_source=False)
    for task in data.load_tasks("train").tasks:
        want = EXPECTED[domain]["tasks"][task.id]["evaluator"]
        assert compare(data, task, want, full=True) == [], (domain, task.id)


def test_telecom_gold_state_is_unsynced_as_tau2s_and_gold_sync_is_ours() -> None:
    """On these tasks tau2's gold user DB keeps the surroundings of before the gold calls, so the
    gold trajectory, which synced, gets ``db_match: false``; ours by default too, field for field.
    The reward does not move (the basis is ENV_ASSERTION); ``gold_sync`` makes the gold state the
    live one, and only ``db_check`` changes."""
    data = load_domain("telecom", FIXTURES, tau2_source=False)
    tasks = data.load_tasks("train").by_id()
    sync_tasks = _fixture_script("make_fixtures").TELECOM_SYNC_TASKS
    assert sync_tasks and set(sync_tasks) <= set(tasks)
    for task_id in sync_tasks:
        task = tasks[task_id]
        tau2_info = EXPECTED["telecom"]["tasks"][task_id]["evaluator"]["reward_info"]["task_basis"]
        assert tau2_info["db_check"] == {"db_match": False, "db_reward": 0.0} and tau2_info["reward"] == 1.0
        sim = gold_simulation(data, task)
        ours = evaluate_tau2(sim, task, data.make_environment, nl_judge=stub_judge)
        assert ours == tau2_info, task_id
        synced = evaluate_tau2(sim, task, data.make_environment, nl_judge=stub_judge, gold_sync=True)
        assert synced["db_check"] == {"db_match": True, "db_reward": 1.0}, task_id
        assert {k: v for k, v in synced.items() if k != "db_check"} == {k: v for k, v in ours.items() if k != "db_check"}
        unsynced, live = gold_state(data, task), gold_state(data, task, gold_sync=True)
        assert unsynced == EXPECTED["telecom"]["tasks"][task_id]["evaluator"]["gold"]
        assert unsynced["user_db_hash"] != live["user_db_hash"], task_id


def _full_data(domain: str) -> tuple[DomainData, list[Task]]:
    """The data ``evaluator_train.json`` was computed on (same DB files, each train task by
    digest), from ``TAU2_DATA_DIR`` or the anchors; skips when absent."""
    want = TRAIN["domains"][domain]
    for cand in (os.environ.get("TAU2_DATA_DIR"), str(ANCHORS)):
        folder = Path(cand or "") / "tau2" / "domains" / domain
        if not cand or not (folder / "tasks.json").is_file():
            continue
        if any(not (folder / n).is_file() or RECIPE.file_sha256(folder / n) != sha for n, sha in want["db_sha256"].items()):
            continue
        raw = {t["id"]: t for t in json.loads((folder / "tasks.json").read_text()) if t["id"] in want["tasks"]}
        if sorted(raw) != sorted(want["tasks"]):
            continue
        drifted = [i for i, t in raw.items() if RECIPE.digest(t) != want["tasks"][i]["task_digest"]]
        assert drifted == [], f"{folder}: train tasks differ from tau2's at {TRAIN['tau2_commit'][:7]}: {drifted[:3]}"
        data = load_domain(domain, folder.parents[2], tau2_source=False)
        return data, [t for t in data.load_tasks("base").tasks if t.id in raw]
    pytest.skip(f"full {domain} data of tau2 {TRAIN['tau2_commit'][:7]} not present (TAU2_DATA_DIR or the anchors)")


@pytest.mark.slow
@pytest.mark.parametrize("domain", DOMAINS)
def test_reward_info_and_gold_state_equal_tau2s_on_every_train_task(domain: str) -> None:
    data, tasks = _full_data(domain)
    want = TRAIN["domains"][domain]["tasks"]
    differ = {t.id: problems for t in tasks if (problems := compare(data, t, want[t.id], full=False))}
    assert differ == {}, f"{len(differ)} of {len(tasks)} tasks differ, e.g. {next(iter(differ.items()))}"
    assert len(tasks) == len(want)


@pytest.mark.parametrize("domain", DOMAINS)
def test_dispatcher_named_arguments_get_tau2s_outputs(domain: str) -> None:
    """``requestor``/``tool_name``/``self`` collide with tau2's ``make_tool_call`` parameters:
    tau2's TypeError text, before any tool lookup (on telecom the user's call of the helper
    ``set_user_info`` too), and nothing changes; a user call without user tools is refused."""
    want = EXPECTED[domain]["dispatcher"]
    env = load_domain(domain, FIXTURES, tau2_source=False).make_environment()
    for i, call in enumerate(want["calls"]):
        got = env.run_tool_call(ToolCall.make(call["name"], call["arguments"], id=f"d{i}"), call["requestor"])
        assert got.text == call["output"], (i, call["name"], call["arguments"])
        assert (got.error is not None) == call["output"].startswith("Error: "), i
    assert env.db.tau2_hash() == want["db_hash"]
    assert (env.user_db.tau2_hash() if env.user_db is not None else None) == want["user_db_hash"]


def _results_file(case: dict, path: Path) -> Path:
    """The case's trials as our export writes them (ungraded: ``reward_info`` null)."""
    tasks = load_domain("retail", FIXTURES, tau2_source=False).load_tasks("train").tasks
    sims = []
    for task_id, rewards in case["trials"].items():
        for trial, reward in enumerate(rewards):
            infra = reward == "infra"
            sims.append(SimulationRun(
                task_id=task_id, trial=trial, termination_reason=TerminationReason.INFRASTRUCTURE_ERROR if infra
                else TerminationReason.USER_STOP,
                reward_info=None if infra else RewardInfo(reward=reward, reward_basis=[RewardType.DB])))
    return write_results(path, sims, tasks, RunInfo(num_trials=case["num_trials"],
                                                    environment_info={"domain_name": "retail", "policy": ""}))


@pytest.mark.parametrize("case", sorted(EXPECTED["metrics"]))
def test_metrics_of_a_results_file_equal_tau2s_compute_metrics(case: str, tmp_path: Path) -> None:
    spec = EXPECTED["metrics"][case]
    sims, _, info = load_tau2_results(_results_file(spec, tmp_path / "results.json"))
    m = results_metrics(sims, info)
    tau2 = spec["tau2"]
    assert m.avg_reward == pytest.approx(tau2["avg_reward"])
    assert {str(k): v for k, v in m.pass_hat_k.items()} == pytest.approx(tau2["pass_hat_ks"])
    assert len(m.infrastructure_errors) == tau2["infra_error_count"]
    assert len(sims) - len(m.infrastructure_errors) == tau2["total_simulations"]
    # ours, by name: the same file read with an ungraded episode left out, each k per task
    ours = results_metrics(sims, info, ungraded="exclude", pass_k="per-task")
    assert ours.conventions.not_tau2() == {"ungraded": "exclude", "pass_k": "per-task"}
    assert sorted(ours.pass_hat_k) == list(range(1, info["num_trials"] + 1))
