"""Grading in worker processes (as tau2's ``--workers``).

Grading is CPU-bound: it builds a fresh environment (validating the whole DB), replays the
episode's writes and the gold actions, and hashes two databases, hundreds of ms on the retail
DB. On the runner's event loop, or in its threads, that holds the GIL and throughput stops
growing with concurrency. :class:`GradingPool` runs :func:`~closedloop.evals.tau.evaluator.grade`
in processes instead; each worker loads the domain once (DB parsed once). Gold states (they
depend only on the data and the task) are shared between the runner and its workers: the runner
sends the one it knows with the episode and keeps the one a worker computed. The judge (an async model client) stays in the caller's process: it is asked first and
its verdict travels to the worker with the episode.

Workers die with the process that owns the pool, however it dies. A SIGKILLed ``closedloop eval
tau`` cannot shut its pool down, and ``ProcessPoolExecutor``'s workers would wait forever on their
call queue (each holds the queue's write end itself, so they never see it close). Each worker
therefore watches its owner from a thread: a pidfd (Linux 5.3+), readable when the owner exits, or
else its parent pid, polled. ``PR_SET_PDEATHSIG`` would be simpler but fires when the *thread* that
spawned the worker exits, and the pool spawns workers from whichever thread submits. The workers
stay in the owner's process group, so a signal to the group (a terminal's Ctrl-C) reaches them
too. A resumed evaluation shares nothing with the workers of a killed one (they hold no file,
lock or port), and those are gone by the time it starts.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.evaluator import grade, needs_judge
from closedloop.evals.tau.evaluator.db_check import cache_gold, cached_gold, gold_cache_key
from closedloop.evals.tau.evaluator.nl_assertions import NLResult, check_nl_assertions
from closedloop.evals.tau.simulation import GRADED_TERMINATIONS, RewardInfo, SimulationRun
from closedloop.models.base import ModelClient

__all__ = ["GradingPool", "default_workers"]

_WORKER_DATA: Any = None


def default_workers(concurrency: int) -> int:
    """No pool below concurrency 4 (its start-up costs more than it saves); otherwise one worker
    per core, at most one per concurrent episode, leaving a core for the event loop."""
    if concurrency < 4:
        return 0
    return max(1, min(concurrency, (os.cpu_count() or 2) - 1))


def _exit_with(owner: int) -> None:
    """End this process as soon as ``owner`` (its parent, the pool's owner) has exited."""
    if os.getppid() != owner:  # the owner died before this worker got here
        os._exit(1)
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(owner)
        except OSError:  # kernel without pidfds
            pidfd = None
    if os.getppid() != owner:  # died between the checks: the pidfd may name a reused pid
        os._exit(1)

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the process has exited
        else:
            while os.getppid() == owner:
                time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="closedloop-owner-watch", daemon=True).start()


def _init(owner: int, domain: str, data_dir: str, options: dict[str, Any]) -> None:
    global _WORKER_DATA
    _exit_with(owner)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from closedloop.evals.tau.data import load_domain

    _WORKER_DATA = load_domain(domain, data_dir, options=options)
    _WORKER_DATA.make_environment()  # parse the DB now, not in the first episode's grading


def _ready() -> bool:
    return _WORKER_DATA is not None


def _grade_in_worker(sim_json: str, task_json: str, task_sha: str | None, nl: NLResult | None,
                     options: dict[str, Any], gold: tuple | None = None) -> tuple[str, tuple | None]:
    """(RewardInfo JSON, the task's gold state as this worker now knows it)."""
    sim = SimulationRun.model_validate_json(sim_json)
    task = Task.model_validate_json(task_json)
    task._source_sha256 = task_sha
    key = gold_cache_key(task, _WORKER_DATA.cache_key)
    if gold is not None:
        cache_gold(key, gold)
    info = grade(sim, task, _WORKER_DATA.make_environment, nl=nl, **options)
    return info.model_dump_json(), cached_gold(key)


class GradingPool:
    """``await pool.grade(sim, task, judge)``: the same RewardInfo as
    :func:`~closedloop.evals.tau.evaluator.evaluate`, computed in a worker process."""

    def __init__(self, domain: str, data_dir: str, workers: int, *, options: dict[str, Any] | None = None,
                 grade_options: dict[str, Any] | None = None, data_key: Any = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self.data_key = data_key  # the data's cache_key: gold states are shared with this process
        self.grade_options = dict(grade_options or {})
        self._executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init,
                                             initargs=(os.getpid(), domain, str(data_dir), dict(options or {})))

    @classmethod
    def for_data(cls, data: Any, workers: int, **kw: Any) -> "GradingPool":
        """From a :class:`~closedloop.evals.tau.data.DomainData` (its folder is ``<root>/tau2/domains/<name>``)."""
        return cls(data.name, str(data.folder.parents[2]), workers, options=data.options,
                   data_key=getattr(data, "cache_key", None), **kw)

    async def grade(self, sim: SimulationRun, task: Task, judge: ModelClient | None = None) -> RewardInfo:
        nl = None
        if sim.termination_reason in GRADED_TERMINATIONS and needs_judge(task, judge_all=False):
            nl = await check_nl_assertions(sim.messages, task.evaluation_criteria.nl_assertions,  # type: ignore[union-attr]
                                           judge)
        loop = asyncio.get_running_loop()
        key = gold_cache_key(task, self.data_key)
        out, gold = await loop.run_in_executor(self._executor, _grade_in_worker, sim.model_dump_json(),
                                               task.model_dump_json(), task.source_sha256, nl, self.grade_options,
                                               cached_gold(key))
        if gold is not None:
            cache_gold(key, gold)
        return RewardInfo.model_validate_json(out)

    def start(self) -> None:
        """Spawn every worker now (each loads the domain in its initializer) without waiting."""
        for _ in range(self.workers):
            self._executor.submit(_ready)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "GradingPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
