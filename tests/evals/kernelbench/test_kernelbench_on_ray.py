"""KernelBench on the ``ray`` executor, on a real local Ray cluster (2 CPUs and the node's one
``cpu_timing`` slot, as ``ray start --resources '{"cpu_timing": 1}'`` declares it).

* ``closedloop eval kernelbench --executor ray`` gives the same verdicts (a correct kernel, an
  incorrect one, a missing candidate) and the same store records as ``--executor local``; the
  verdicts are reached in the workers' own sandboxed judge processes, written by the driver.
* A worker SIGKILLed after judging a sample but before handing it back: with retries, Ray runs the
  sample again and the store holds it once; without, it is an ``infra_error`` (never a lost
  sample) that a resume runs again.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

import pytest

from closedloop.cli import main
from closedloop.evals.harness import ExecutorConfig
from closedloop.evals.kernelbench.problems import load_problems
from closedloop.evals.kernelbench.runner import CPU_TIMING, KernelBenchRunner, KernelBenchSettings, RemoteSample
from closedloop.store import RunStore

from .conftest import PROBLEMS, RELU_OK

ray = pytest.importorskip("ray")
RayExecutor = pytest.importorskip("closedloop.evals.harness.ray_executor").RayExecutor


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance for this module (a short temp dir: Ray's socket paths stay under 107
    bytes); its one node declares the CPU-timing slot a KernelBench node declares."""
    temp = tempfile.mkdtemp(prefix="clkb-")
    context = ray.init(num_cpus=2, resources={CPU_TIMING: 1}, include_dashboard=False,
                       object_store_memory=200 * 1024 * 1024, log_to_driver=False, _temp_dir=temp)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the killer wrapper travels by value
    try:
        yield context.address_info["address"]
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _candidates(root):
    """Problem 1: a correct ReLU; problem 3: one that returns its input (incorrect); problem 2: none."""
    root.mkdir()
    (root / "level_1_problem_1_sample_0_kernel.py").write_text(RELU_OK)
    alias = RELU_OK.replace("        return relu_ext.relu_forward(x)", "        relu_ext.relu_forward(x)\n        return x")
    (root / "level_1_problem_3_sample_0_kernel.py").write_text(alias)
    return root


def _verdicts(store_path, name: str) -> dict[tuple[str, int], tuple[Any, ...]]:
    """(problem, sample) -> (outcome, status, max_diff, timed, error) of every stored sample record."""
    store = RunStore(store_path)
    parent = store.list_runs(kind="eval", tag=f"eval:{name}")[0]
    out: dict[tuple[str, int], tuple[Any, ...]] = {}
    for run in store.list_runs(limit=None, parent_id=parent.id):
        o = run.outcome
        key = (o["problem"], o["sample_id"])
        assert key not in out, f"{key} stored twice"
        res = o["result"] or {}
        out[key] = (o["outcome"], res.get("status"), res.get("max_diff"), res.get("timed"), o["error"])
    return out


def test_cli_on_ray_gives_the_verdicts_of_local(ray_cluster, relu_result, kb_cache, tmp_path, capsys):
    cands = _candidates(tmp_path / "cands")
    verdicts = {}
    for kind in ("local", "ray"):
        store = tmp_path / f"{kind}.duckdb"
        code = main(["eval", "kernelbench", "--problems", str(PROBLEMS), "--level", "1", "--candidates", str(cands),
                     "--store", str(store), "--name", "kb", "--cache-dir", str(kb_cache), "--scale", "0.25",
                     "--trials", "2", "--iters", "3", "--executor", kind])
        assert code == 0, capsys.readouterr().err
        verdicts[kind] = _verdicts(store, "kb")
        assert RunStore(store).list_runs(kind="eval", tag="eval:kb")[0].config["executor"] == kind
    assert {k: v[:2] for k, v in verdicts["local"].items()} == {("level1/1_ReLU.py", 0): ("graded", "correct"),
                                                               ("level1/2_Scale_Add.py", 0): ("agent_error", None),
                                                               ("level1/3_ReLU_Positive.py", 0): ("graded", "incorrect")}
    assert verdicts["ray"] == verdicts["local"]
    # a resume on the other executor runs nothing again
    capsys.readouterr()
    assert main(["eval", "kernelbench", "--problems", str(PROBLEMS), "--level", "1", "--candidates", str(cands),
                 "--store", str(tmp_path / "ray.duckdb"), "--name", "kb", "--cache-dir", str(kb_cache),
                 "--scale", "0.25", "--trials", "2", "--iters", "3", "--resume"]) == 0
    assert "ran 0, from store 3" in capsys.readouterr().out


async def _killed_before_handing_back(marker: str, inner: Any, job: RemoteSample) -> Any:
    """The first attempt judges its sample, then its worker process is SIGKILLed before the verdict
    leaves it; a later attempt (Ray's retry, or a resume) runs as usual."""
    outcome = await inner(job)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return outcome
    os.kill(os.getpid(), signal.SIGKILL)


class _KillingRunner(KernelBenchRunner):
    marker = ""

    def _work(self):
        work = super()._work()
        return dataclasses.replace(work, remote=functools.partial(_killed_before_handing_back, self.marker,
                                                                  work.remote))


async def _run_killing(settings, problems, store, marker, max_retries: int, *, resume: bool = False):
    executor = RayExecutor(ExecutorConfig(kind="ray", max_retries=max_retries))
    runner = _KillingRunner(settings, problems, store, executor=executor)
    runner.marker = str(marker)
    try:
        return await runner.run(resume=resume)
    finally:
        executor.close()


async def test_a_killed_worker_is_retried_or_an_infra_error_resume_reruns(ray_cluster, relu_result, kb_cache,
                                                                           tmp_path):
    problems = [p for p in load_problems(PROBLEMS, level=1) if p.problem_id == 1]
    settings = KernelBenchSettings(name="kill", candidates_dir=str(_candidates(tmp_path / "cands")),
                                   cache_dir=str(kb_cache), scale=0.25, trials=2, iters=3)
    key = ("level1/1_ReLU.py", 0)

    retried = tmp_path / "retried.duckdb"
    report = await _run_killing(settings, problems, RunStore(retried), tmp_path / "once", max_retries=1)
    assert (tmp_path / "once").exists()  # the first attempt's worker was killed
    assert report.outcomes == {"graded": 1}
    assert {k: v[:2] for k, v in _verdicts(retried, "kill").items()} == {key: ("graded", "correct")}

    lost = tmp_path / "no-retry.duckdb"
    report = await _run_killing(settings, problems, RunStore(lost), tmp_path / "twice", max_retries=0)
    assert report.outcomes == {"infra_error": 1} and "harness:" in report.errors[0]["error"]
    report = await _run_killing(settings, problems, RunStore(lost), tmp_path / "twice", max_retries=0, resume=True)
    assert report.outcomes == {"graded": 1} and report.ran == 1
    store = RunStore(lost)
    parent = store.list_runs(kind="eval", tag="eval:kill")[0]
    assert sorted(r.outcome["outcome"] for r in store.list_runs(limit=None, parent_id=parent.id)) == \
        ["graded", "infra_error"]  # the failed attempt stays on record; the verdict is the graded one


def test_a_request_no_node_holds_is_refused_before_any_sample_runs(ray_cluster, kb_cache, tmp_path, capsys):
    """``--ray-gpus 1`` replaces only the GPU part of a cpu sample's request (CPU 1, cpu_timing 1):
    no node of this cluster has a GPU, so the run stops with a clear error instead of waiting."""
    argv = ["eval", "kernelbench", "--problems", str(PROBLEMS), "--level", "1", "--candidate-source", "reference",
            "--store", str(tmp_path / "s.duckdb"), "--name", "gpu", "--cache-dir", str(kb_cache), "--ray-gpus", "1"]
    assert main(argv) == 2
    assert "--ray-gpus needs --executor ray" in capsys.readouterr().err
    assert main([*argv, "--executor", "ray"]) == 2
    assert "no node of the Ray cluster has CPU 1, GPU 1, cpu_timing 1 for one item" in capsys.readouterr().err
    parent = RunStore(tmp_path / "s.duckdb").list_runs(kind="eval", tag="eval:gpu")[0]
    assert RunStore(tmp_path / "s.duckdb").list_runs(limit=None, parent_id=parent.id) == []  # no sample ran
