"""Grading in worker processes gives the same record as grading in-process."""

from __future__ import annotations

from closedloop.evals.tau import evaluate, run_episode
from closedloop.evals.tau.oracle import OracleAgent, ScenarioUser
from closedloop.evals.tau.simulation import SimulationRun, TerminationReason
from closedloop.evals.tau.workers import GradingPool, default_workers

from ._support import ScriptedClient


def _judge() -> ScriptedClient:
    import json

    def answer(messages):
        outcomes = eval(messages[-1].text.split("expectedOutcomes:")[1].strip())
        return json.dumps({"results": [{"expectedOutcome": o, "reasoning": "r", "metExpectation": True}
                                       for o in outcomes]})
    return ScriptedClient(answer)


async def test_worker_grades_equal_in_process_grades(mini):
    tasks = mini.load_tasks("base").tasks
    with GradingPool.for_data(mini, 2) as pool:
        for task in tasks:
            sim = await run_episode(task, OracleAgent(task), ScenarioUser(task), environment_factory=mini.make_environment)
            here = await evaluate(sim, task, mini.make_environment, _judge())
            there = await pool.grade(sim, task, _judge())
            assert there.model_dump(exclude={"judge_usage"}) == here.model_dump(exclude={"judge_usage"}), task.id
            assert there.task_file_sha256 == task.source_sha256
        gated = SimulationRun(task_id=tasks[0].id, termination_reason=TerminationReason.MAX_STEPS)
        assert (await pool.grade(gated, tasks[0])).reward == 0.0


def test_default_workers():
    assert default_workers(1) == 0 and default_workers(3) == 0 and default_workers(8) >= 1


async def test_gold_states_are_shared_with_the_workers(mini):
    """A gold state computed in a worker comes back to the runner's cache, and one the runner
    knows is used by the worker: here a forged one, so the worker's verdict shows it was used."""
    from closedloop.evals.tau.evaluator import db_check

    task = mini.load_tasks("base").tasks[0]
    key = db_check.gold_cache_key(task, mini.cache_key)
    db_check._GOLD_CACHE.pop(key, None)
    sim = await run_episode(task, OracleAgent(task), ScenarioUser(task), environment_factory=mini.make_environment)
    with GradingPool.for_data(mini, 1) as pool:
        assert (await pool.grade(sim, task, _judge())).db_check.db_match
        known = db_check.cached_gold(key)
        gold = mini.make_environment()
        gold.apply_initial_state(task.initial_state)
        db_check.replay_gold(gold, task)
        assert known is not None and known[0] == gold.get_db_hash()
        db_check.cache_gold(key, ("forged", None, []))
        assert not (await pool.grade(sim, task, _judge())).db_check.db_match
    db_check._GOLD_CACHE.pop(key, None)
