"""Every built-in domain against tau2 on committed fixtures (``fixtures/``: a few train tasks per
domain, the DB rows they touch, tau2's MIT LICENSE, and tau2's own outputs and DB hashes for the
gold actions on that small DB, made by ``fixtures/make_fixtures.py``): tool schemas, every gold
action's output, the final hash, and the oracle through orchestrator and evaluator. With full
data (``TAU2_DATA_DIR``), the oracle is also checked on every train task of each domain, and with
real tau2 as well (``TAU2_PYTHON``), every train task's gold outputs and hashes are compared with
tau2's. The two data files snapshots often lack (airline ``db.json``, telecom ``tasks.json``) are
rebuilt byte for byte by ``fixtures/rebuild_tau2_data.py``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from closedloop.evals.tau import RewardType, TerminationReason, evaluate, load_domain, run_episode
from closedloop.evals.tau.simulation import SimulationRun
from closedloop.evals.tau.user_messages import TauUserMessage
from closedloop.evals.tau.domains import available_domains
from closedloop.evals.tau.domains.registry import UnknownDomainError, get_domain
from closedloop.evals.tau.oracle import OracleAgent, ScenarioUser
from closedloop.messages import ToolCall

FIXTURES = Path(__file__).parent / "fixtures"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
DOMAINS = sorted(d for d, v in EXPECTED.items() if "tools" in v)  # besides "metrics"
ORACLE_DOMAINS = DOMAINS  # telecom's oracle user makes the gold user tool calls itself


@pytest.mark.parametrize("domain", DOMAINS)
def test_schemas_outputs_and_hashes_equal_tau2s(domain: str) -> None:
    data = load_domain(domain, FIXTURES, tau2_source=False)
    env = data.make_environment()
    assert [t.schema for t in env.tool_list] == EXPECTED[domain]["tools"]
    assert env.policy == EXPECTED[domain]["policy"]
    if "user_tools" in EXPECTED[domain]:
        assert [t.schema for t in env.user_tools] == EXPECTED[domain]["user_tools"]
    for task in data.load_tasks("train").tasks:
        env = data.make_environment()
        env.apply_initial_state(task.initial_state)
        outputs = [env.run_tool_call(ToolCall.make(a.name, a.arguments, id=f"g{i}"), a.requestor).text
                   for i, a in enumerate(task.evaluation_criteria.actions or [])]
        want = EXPECTED[domain]["tasks"][task.id]
        assert outputs == want["outputs"], (domain, task.id)
        assert env.db.tau2_hash() == want["db_hash"], (domain, task.id)
        if "user_db_hash" in want:  # dual control: the user's phone, and the env assertions on it
            assert env.user_db.tau2_hash() == want["user_db_hash"], (domain, task.id)
            assertions = [env.run_env_assertion(a)[0] for a in task.evaluation_criteria.env_assertions or []]
            assert assertions == want["assertions"] and all(assertions), (domain, task.id)


async def _oracle(data, tasks) -> list[str]:
    """Ids of the tasks whose oracle episode does not reproduce the gold DB (the gold actions'
    live state: ``gold_sync``; tau2's unsynced gold state is checked by test_evaluator_parity)."""
    bad = []
    for task in tasks:
        sim = await run_episode(task, OracleAgent(task), ScenarioUser(task), environment_factory=data.make_environment)
        info = await evaluate(sim, task, data.make_environment, gold_sync=True)
        env_only = task.reward_basis == [RewardType.ENV_ASSERTION]  # telecom: graded by assertions alone
        if (sim.termination_reason != TerminationReason.USER_STOP or not info.db_check.db_match
                or (env_only and info.reward != 1.0)):
            bad.append(task.id)
        user_calls = [m for m in sim.messages if isinstance(m, TauUserMessage) and m.tool_calls]
        assert len(user_calls) == sum(a.requestor == "user" for a in task.evaluation_criteria.actions or [])
        if user_calls:  # stored and read back with the user's tool calls
            again = SimulationRun.model_validate_json(sim.model_dump_json())
            assert [m.tool_calls for m in again.messages if isinstance(m, TauUserMessage) and m.tool_calls] == \
                [m.tool_calls for m in user_calls]
    return bad


@pytest.mark.parametrize("domain", ORACLE_DOMAINS)
async def test_oracle_matches_gold_on_the_fixture_tasks(domain: str) -> None:
    data = load_domain(domain, FIXTURES, tau2_source=False)
    assert await _oracle(data, data.load_tasks("train").tasks) == []


FULL = os.environ.get("TAU2_DATA_DIR")


@pytest.mark.slow
@pytest.mark.parametrize("domain", ORACLE_DOMAINS)
async def test_oracle_matches_gold_on_every_train_task_with_full_data(domain: str) -> None:
    if not FULL or not (Path(FULL) / "tau2" / "domains" / domain / "tasks.json").is_file():
        pytest.skip(f"full {domain} data not present (set TAU2_DATA_DIR)")
    data = load_domain(domain, FULL)
    split = "train" if "train" in data.splits() else "base"  # e.g. telecom's tasks_small.json as tasks.json
    assert await _oracle(data, data.load_tasks(split).tasks) == []


TAU2_PYTHON = os.environ.get("TAU2_PYTHON")


@pytest.mark.slow
@pytest.mark.parametrize("domain", ["airline", "telecom"])
def test_outputs_and_hashes_equal_real_tau2s_on_every_train_task(domain: str, tmp_path: Path) -> None:
    if not FULL or not TAU2_PYTHON or not (Path(FULL) / "tau2" / "domains" / domain / "tasks.json").is_file():
        pytest.skip("set TAU2_DATA_DIR (full data) and TAU2_PYTHON (a Python that imports tau2)")
    gold_path = tmp_path / "gold.json"
    run = subprocess.run([TAU2_PYTHON, str(FIXTURES / "tau2_train_gold.py"), FULL, str(gold_path)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "TAU2_DATA_DIR": FULL})
    assert run.returncode == 0, run.stderr[-2000:]
    gold = json.loads(gold_path.read_text())[domain]
    data = load_domain(domain, FULL, tau2_source=False)
    tasks = data.load_tasks("train").tasks
    assert sorted(t.id for t in tasks) == sorted(gold)
    for task in tasks:
        env = data.make_environment()
        env.apply_initial_state(task.initial_state)
        outputs = [env.run_tool_call(ToolCall.make(a.name, a.arguments, id=f"g{i}"), a.requestor).text
                   for i, a in enumerate(task.evaluation_criteria.actions or [])]
        want = gold[task.id]
        assert outputs == want["outputs"], task.id
        assert env.db.tau2_hash() == want["db_hash"], task.id
        if "user_db_hash" in want:
            assert env.user_db.tau2_hash() == want["user_db_hash"], task.id
            assert [env.run_env_assertion(a)[0] for a in task.evaluation_criteria.env_assertions or []] == \
                want["assertions"], task.id


def test_unknown_domain_is_one_line_listing_the_domains() -> None:
    with pytest.raises(UnknownDomainError) as e:
        get_domain("bank")
    text = str(e.value)
    assert "\n" not in text and "'bank'" in text and "airline" in text and "retail" in text
    assert {"airline", "retail", "telecom"} <= set(available_domains())
