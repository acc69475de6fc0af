"""Grading in worker processes gives the same record as grading in-process, and the workers do
not outlive the process that owns them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


OWNER = """
import asyncio, json, os, sys
from pathlib import Path
from closedloop.evals.tau import load_domain
from closedloop.evals.tau.simulation import SimulationRun, TerminationReason
from closedloop.evals.tau.workers import GradingPool

data = load_domain("retail", sys.argv[1])
task = data.load_tasks("base").tasks[0]
gated = SimulationRun(task_id=task.id, termination_reason=TerminationReason.MAX_STEPS)


async def main():
    pool = GradingPool.for_data(data, 2)
    pool.start()
    rewards = await asyncio.gather(*(pool.grade(gated, task) for _ in range(4)))  # the pool answers
    children = sorted({int(pid) for f in Path("/proc/self/task").glob("*/children") for pid in f.read_text().split()})
    print(json.dumps({"rewards": [r.reward for r in rewards], "children": children}), flush=True)
    sys.stdin.read()  # hold the pool until killed


asyncio.run(main())
"""


def _started_at(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), or None once it is gone or a zombie
    (a zombie has exited; in a container nobody may reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads process trees from /proc (Linux)")
def test_workers_die_with_a_sigkilled_owner(mini_root):
    """SIGKILL the process that owns a grading pool once the pool has answered: every process it
    spawned (the two workers and multiprocessing's resource tracker) exits too."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(mini_root)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()
        assert line, owner.stderr.read()[-3000:]
        report = json.loads(line)
        assert report["rewards"] == [0.0] * 4
        started = {pid: _started_at(pid) for pid in report["children"]}
        assert len(started) >= 2 and all(started.values())
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 120  # generous: the condition is polled, load only makes it slower
    alive = started
    while alive and time.monotonic() < deadline:
        alive = {pid: t for pid, t in alive.items() if _started_at(pid) == t}
        time.sleep(0.05)
    for pid in alive:  # leave no orphans behind when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes outlived their SIGKILLed owner: {sorted(alive)}"
