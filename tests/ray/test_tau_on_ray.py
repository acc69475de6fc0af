"""τ-bench on the ``ray`` executor, on a real local Ray cluster.

* The oracle evaluation gives the same episodes, metrics and results.json as ``local``, and a
  worker SIGKILLed after finishing an episode but before handing it back is retried by Ray: the
  store holds every episode exactly once.
* ``closedloop eval tau --executor ray --ray-address ADDR`` killed (SIGKILL) mid-run resumes on Ray
  and runs only the missing episodes (none lost, none twice).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from closedloop.evals.harness import ExecutorConfig, LocalExecutor
from closedloop.evals.harness.ray_executor import RayExecutor
from closedloop.evals.tau import load_domain
from closedloop.evals.tau.eval_store import find_eval, load_episodes
from closedloop.evals.tau.orchestrator import STOP, load_user_guidelines
from closedloop.evals.tau.runner import EvalSettings, RemoteEpisode, TauRunner, export_results
from closedloop.messages import AssistantMessage, Turn, Usage
from closedloop.models.base import ModelClient
from closedloop.server import create_app
from closedloop.server.local import serve_app
from closedloop.store import RunStore

TASKS = ["0", "1", "2", "3"]
VOLATILE = {"id", "start_time", "end_time", "duration", "timestamp", "eval_run_id", "git_commit"}


def _without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def _setup(root: Path, trials: int = 2):
    data = load_domain("retail", root)
    taskset = data.load_tasks("base", task_ids=TASKS)
    settings = EvalSettings(name="oracle", domain="retail", split="base", data_dir=str(root),
                            task_file_sha256=taskset.sha256, task_ids=TASKS, agent="oracle", trials=trials,
                            concurrency=2)
    return data, taskset.tasks, settings


# ---------------------------------------------------------------------- a worker killed mid-episode


async def _held_after_the_episode(marker: str, victim: tuple[str, int], inner: Any, job: RemoteEpisode) -> Any:
    """The victim's first attempt finishes its episode, says which process it is, then waits to be
    killed before handing the episode back; its retry (and every other episode) runs as usual."""
    sim = await inner(job)
    if (job.task.id, job.trial) != victim:
        return sim
    try:
        os.close(os.open(marker + ".claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return sim  # the retry
    with open(marker + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(marker + ".tmp", marker)
    await asyncio.Event().wait()


class _KillableRunner(TauRunner):
    marker = ""

    def _work(self):
        work = super()._work()
        return dataclasses.replace(work, remote=functools.partial(_held_after_the_episode, self.marker, ("1", 0),
                                                                  work.remote))


async def _pid_when_held(marker: Path, run: asyncio.Future) -> int:
    """The victim worker's pid, once it holds its finished episode (a deadline only against a hang)."""
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert not run.done(), run.result()
        assert time.monotonic() < deadline, "the victim episode never finished"
        await asyncio.sleep(0.05)
    return int(marker.read_text())


async def test_oracle_on_ray_equals_local_and_a_killed_worker_is_retried_once(ray_cluster, tau_root, tmp_path):
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test's wrapper travels by value
    data, tasks, settings = _setup(tau_root)
    guidelines = load_user_guidelines(tau_root)
    local_store = RunStore(tmp_path / "local.duckdb")
    local = await TauRunner.from_settings(settings, tasks, data, local_store, guidelines=guidelines,
                                          executor=LocalExecutor()).run()

    ray_store = RunStore(tmp_path / "ray.duckdb")
    runner = _KillableRunner.from_settings(settings, tasks, data, ray_store, guidelines=guidelines,
                                           executor=RayExecutor(ExecutorConfig(kind="ray", address=ray_cluster)))
    assert isinstance(runner, _KillableRunner)
    runner.marker = str(tmp_path / "victim.pid")
    run = asyncio.ensure_future(runner.run())
    os.kill(await _pid_when_held(tmp_path / "victim.pid", run), signal.SIGKILL)
    remote = await run

    assert remote.status == local.status == "completed" and remote.ran == local.ran == 8
    records = load_episodes(ray_store, remote.parent_id)
    assert sorted(r.key for r in records) == sorted((t, k) for t in TASKS for k in (0, 1))  # each once
    assert all(r.status == "completed" for r in records)
    assert ray_store.get_run(remote.parent_id).config["executor"] == "ray"
    assert ([_without_volatile(s.model_dump(mode="json")) for s in remote.simulations]
            == [_without_volatile(s.model_dump(mode="json")) for s in local.simulations])
    assert remote.metrics.pass_hat_k == local.metrics.pass_hat_k and remote.summary["episodes"] == 8
    files = {}
    for kind, store in (("local", local_store), ("ray", ray_store)):
        export_results(store, "oracle", tasks, str(tmp_path / f"{kind}.json"))
        files[kind] = _without_volatile(json.loads((tmp_path / f"{kind}.json").read_text()))
    assert files["ray"] == files["local"]


# ---------------------------------------------------------------------- a driver killed mid-run


class _GatedUser(ModelClient):
    """The user behind the test's server: the reason for calling, then ``###STOP###``; calls after
    the first ``open_calls`` wait until ``gate`` is set. ``stops``: episodes it has ended (each is
    then graded and written); ``waiting``: calls held at the gate."""

    spec = "gated-user"

    def __init__(self, open_calls: int) -> None:
        self.open_calls, self.calls, self.stops, self.waiting = open_calls, 0, 0, 0
        self.gate = threading.Event()

    async def generate(self, messages, tools=None, params=None, tool_choice=None) -> Turn:
        self.calls += 1
        if self.calls > self.open_calls:
            self.waiting += 1
            while not self.gate.is_set():
                await asyncio.sleep(0.02)
            self.waiting -= 1
        spoken = sum(1 for m in messages if m.role == "assistant")
        self.stops += spoken > 0
        return Turn(message=AssistantMessage(content="I want to cancel an order." if spoken == 0 else STOP),
                    model=self.spec, usage=Usage(prompt_tokens=5, completion_tokens=2))


def _stored(store: RunStore) -> int:
    parent = find_eval(store, "crash")
    return len(load_episodes(store, parent.id)) if parent else 0


def test_cli_driver_killed_mid_run_resumes_on_ray_without_losing_or_repeating(ray_cluster, tau_root, tmp_path):
    store_path = tmp_path / "runs.duckdb"
    user = _GatedUser(open_calls=6)  # 2 calls per episode: a few episodes finish, the others wait
    env = {**os.environ, "CLOSEDLOOP_HOME": str(tmp_path / "home")}
    with serve_app(create_app(user, "user")) as url:
        command = [sys.executable, "-m", "closedloop", "eval", "tau", "--agent", "oracle", "--user-model",
                   f"openai:user@{url}", "--data-dir", str(tau_root), "--task-ids", *TASKS, "--trials", "2",
                   "--store", str(store_path), "--name", "crash", "--executor", "ray", "--ray-address", ray_cluster]
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            # Stalled: both Ray slots hold an episode waiting at the gate, and every episode the user
            # ended is written (a deadline only against a hang).
            deadline = time.monotonic() + 600
            while not (user.waiting == 2 and 0 < user.stops == _stored(RunStore(store_path))):
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, f"the run never stalled ({user.calls} user calls)"
                time.sleep(0.2)
            stored = user.stops
            proc.kill()
            proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        store = RunStore(store_path)
        assert find_eval(store, "crash").status == "killed" and _stored(store) == stored < 8  # finished ones kept
        user.gate.set()
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ran {8 - stored}, from store {stored}" in done.stdout
    parent = find_eval(store, "crash")
    records = load_episodes(store, parent.id)
    assert sorted(r.key for r in records) == sorted((t, k) for t in TASKS for k in (0, 1))  # none lost, none twice
    assert parent.status == "completed" and parent.metadata["attempts"] == 2


@pytest.mark.parametrize("argv, message", [(["--ray-address", "auto"], "--ray-address needs --executor ray")])
def test_ray_flags_without_the_ray_executor_are_refused(tau_root, tmp_path, argv, message, capsys):
    from closedloop.cli import main

    assert main(["eval", "tau", "--agent", "oracle", "--data-dir", str(tau_root), "--task-ids", "0",
                 "--store", str(tmp_path / "s.duckdb"), *argv]) == 2
    assert message in capsys.readouterr().err
