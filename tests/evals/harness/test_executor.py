"""The executor interface without Ray: ``local`` is the default and runs with Ray not importable;
``--executor ray`` without Ray is a one-line error; configs read as documented. (Ray itself:
``tests/ray/``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from closedloop.evals.harness import BatchRunner, ExecutorConfig, ItemWork, LocalExecutor, Resources, make_executor

REPO = Path(__file__).resolve().parents[3]
WITHOUT_RAY = """
import json, sys
sys.modules["ray"] = None  # `import ray` now fails as it does where Ray is not installed
from closedloop.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "ray_imported": any(m == "ray" or m.startswith("ray.") for m in sys.modules
                                                      if sys.modules[m] is not None)}))
"""


def _anchors() -> Path:
    for cand in (os.environ.get("TAU2_DATA_DIR"), REPO.parent / "shared" / "anchors"):
        if cand and (Path(cand) / "tau2" / "domains" / "retail" / "tasks.json").is_file():
            return Path(cand)
    pytest.skip("τ anchors not present")


def _without_ray(*argv: str, cwd: Path) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", WITHOUT_RAY, *argv], capture_output=True, text=True, timeout=600,
                          cwd=cwd)
    assert done.stdout.strip(), done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_local_is_the_default_and_needs_no_ray(tmp_path):
    root = _anchors()
    common = ["eval", "tau", "--agent", "oracle", "--data-dir", str(root), "--task-ids", "0",
              "--store", str(tmp_path / "runs.duckdb")]
    out, _ = _without_ray(*common, "--name", "local", cwd=tmp_path)
    assert out == {"code": 0, "ray_imported": False}
    out, err = _without_ray(*common, "--name", "remote", "--executor", "ray", cwd=tmp_path)
    assert out["code"] == 2 and "--executor ray needs Ray: pip install 'closedloop[ray]'" in err


async def test_batch_runner_runs_an_item_work_here_on_the_local_executor():
    async def double(i: int) -> int:
        return 2 * i

    out: list[int] = []
    work = ItemWork(local=double, remote=abs, payload=lambda i: i)  # the remote side is not used here
    assert await BatchRunner(work, out.append, concurrency=2, executor=LocalExecutor()).run([1, 2, 3]) == 3
    assert sorted(out) == [2, 4, 6]


def test_executor_config_and_resources():
    assert ExecutorConfig.model_validate("ray").kind == "ray"
    assert isinstance(make_executor(None), LocalExecutor) and isinstance(make_executor("local"), LocalExecutor)
    with pytest.raises(ValueError):
        ExecutorConfig.model_validate({"kind": "dask"})
    with pytest.raises(ValueError):
        ExecutorConfig.model_validate({"kind": "ray", "worker": 2})  # a typo is refused, not ignored
    r = Resources(num_cpus=0.25, num_gpus=1, memory_mb=512, custom={"cpu_timing": 1})
    assert r.ray_options() == {"num_cpus": 0.25, "num_gpus": 1, "memory": 512 * 1024 * 1024,
                               "resources": {"cpu_timing": 1}}
