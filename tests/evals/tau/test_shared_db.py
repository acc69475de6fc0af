"""Environments share one pristine JSON DB until they write: a write (mutating tool, toolkit
function, ``env.db``) first takes a private copy, so no environment ever sees another's changes
and the pristine DB never changes, whatever the episodes do."""

from __future__ import annotations

from pathlib import Path

import pytest

from closedloop.evals.tau import evaluate, load_domain, run_episode
from closedloop.evals.tau.oracle import OracleAgent, ScenarioUser
from closedloop.messages import ToolCall

FIXTURES = Path(__file__).parent / "fixtures"


def _fresh_hash(data) -> str:
    return data.domain.db_model.load(data.folder / "db.json").get_hash()


@pytest.mark.parametrize("domain", ["retail", "airline"])
async def test_writes_copy_and_the_pristine_db_never_changes(domain: str) -> None:
    data = load_domain(domain, FIXTURES, tau2_source=False)
    tasks = data.load_tasks("train").tasks
    a, b = data.make_environment(), data.make_environment()
    assert a.toolkit.db is b.toolkit.db  # shared until a write
    write = next(x for t in tasks for x in t.evaluation_criteria.actions or [] if data.is_mutating_tool(x.name))
    result = a.run_tool_call(ToolCall.make(write.name, write.arguments, id="w"))
    assert result.error is None and a.toolkit.db is not b.toolkit.db
    assert b.get_db_hash() == _fresh_hash(data) != a.get_db_hash() == a.toolkit.db.get_hash()
    for task in tasks:  # whole episodes and their grading, reads and writes
        sim = await run_episode(task, OracleAgent(task), ScenarioUser(task), environment_factory=data.make_environment)
        info = await evaluate(sim, task, data.make_environment)
        assert info.db_check.db_match, task.id
    assert data.make_environment().get_db_hash() == _fresh_hash(data)
    assert data._pristine is not None and data._pristine.get_hash() == _fresh_hash(data)


def test_reading_env_db_gives_a_private_copy() -> None:
    data = load_domain("retail", FIXTURES, tau2_source=False)
    env = data.make_environment()
    shared = env.toolkit.db
    db = env.db  # the caller may write through it
    assert db is not shared and db == shared and env.toolkit.db is db
