"""The ``ray`` executor against ``local`` on the τ-bench oracle evaluation: overhead per episode, and
how throughput scales with worker nodes in a simulated multi-node cluster on this host.

1. **Overhead** (goal: at most 10 ms per episode). The same oracle evaluation (anchors' retail DB,
   ``--tasks`` tasks, one trial, concurrency 1 so episodes do not overlap) runs on ``local`` and on
   ``ray`` (a local Ray instance with one CPU), interleaved ``--repeats`` times after one untimed
   warm-up run of each (Ray's workers start and load the domain once per driver). Per episode:
   wall time, and CPU time of every thread of every process involved (this driver, and on Ray the
   GCS, raylet and worker processes it started, read from ``/proc`` through psutil). The no-op item
   round trip (``BatchRunner`` over an item that returns at once) isolates the executor's own cost.
Ray starts its worker processes at niceness 15; on a shared host that alone makes them slower than
the driver (they yield to every other process), so the comparison runs them at the driver's
niceness (``--worker-niceness``, default 0; pass 15 for Ray's default).

2. **Scaling** (``--nodes``). A head node with no CPUs (the driver's) and worker nodes with one CPU
   each, every node its own ``ray start --block`` process with its own temp dir, joined with a
   shared token; the evaluation runs with one episode in flight per worker CPU. Episodes/s per
   node count, with this host's core count and load: nodes beyond the cores share them.

    python benchmarks/bench_ray.py                      # 20 tasks, 3 repeats, 1 and 2 worker nodes
    python benchmarks/bench_ray.py --tasks 40 --repeats 5 --nodes 1 2 3 --data-dir /path/to/tau2-data
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]


def _anchors(data_dir: str | None) -> Path:
    for cand in (data_dir, os.environ.get("TAU2_DATA_DIR"), REPO.parent / "shared" / "anchors"):
        if cand and (Path(cand) / "tau2" / "domains" / "retail" / "tasks.json").is_file():
            return Path(cand)
    raise SystemExit("no τ data: pass --data-dir or set TAU2_DATA_DIR")


def _cpu_of(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class CpuMeter:
    """CPU seconds of this process (all threads) plus its descendants (a Ray instance it started)."""

    def __init__(self) -> None:
        self.me = psutil.Process()

    def __call__(self) -> float:
        return _cpu_of([self.me, *self.me.children(recursive=True)])


async def _eval(executor: Any, root: Path, tasks_n: int, concurrency: int, store_dir: Path, name: str) -> int:
    from closedloop.evals.tau import load_domain
    from closedloop.evals.tau.orchestrator import load_user_guidelines
    from closedloop.evals.tau.runner import EvalSettings, TauRunner
    from closedloop.store import RunStore

    data = load_domain("retail", root)
    taskset = data.load_tasks("base")
    tasks = taskset.tasks[:tasks_n]
    settings = EvalSettings(name=name, domain="retail", split="base", data_dir=str(root),
                            task_file_sha256=taskset.sha256, task_ids=[t.id for t in tasks], agent="oracle",
                            concurrency=concurrency, workers=0)
    store = RunStore(store_dir / f"{name}.duckdb")
    report = await TauRunner.from_settings(settings, tasks, data, store, guidelines=load_user_guidelines(root),
                                           executor=executor).run()
    assert report.status == "completed" and report.ran == len(tasks), report.summary
    return report.ran


def _timed(fn: Any, meter: CpuMeter) -> tuple[float, float, Any]:
    c0, t0 = meter(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, meter() - c0, out


def overhead(root: Path, tasks_n: int, repeats: int, store_dir: Path, console: Console) -> dict[str, float]:
    import ray

    from closedloop.evals.harness import BatchRunner, ExecutorConfig, ItemWork, LocalExecutor
    from closedloop.evals.harness.ray_executor import RayExecutor

    ray_temp = tempfile.mkdtemp(prefix="clbr-")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20,
             _temp_dir=ray_temp)
    executors = {"local": LocalExecutor(), "ray": RayExecutor(ExecutorConfig(kind="ray"))}
    meter = CpuMeter()
    runs = {k: 0 for k in executors}

    def once(kind: str) -> int:
        runs[kind] += 1
        return asyncio.run(_eval(executors[kind], root, tasks_n, 1, store_dir, f"{kind}-{runs[kind]}"))

    for kind in executors:  # warm-up: Ray's worker starts, imports and loads the domain here
        once(kind)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(repeats):  # interleaved
        for kind in executors:
            wall, cpu, n = _timed(lambda: once(kind), meter)
            prev = best.get(kind)
            if prev is None or wall / n < prev[0]:
                best[kind] = (wall / n, cpu / n)

    async def noop_items(kind: str, n: int) -> None:
        async def nothing(i: int) -> int:
            return i
        out: list[int] = []
        work = ItemWork(local=nothing, remote=abs, payload=lambda i: i)
        await BatchRunner(work, out.append, concurrency=1, executor=executors[kind]).run(list(range(n)))

    items = 200
    noop: dict[str, tuple[float, float]] = {}
    for kind in executors:
        asyncio.run(noop_items(kind, 20))
    for _ in range(repeats):
        for kind in executors:
            wall, cpu, _ = _timed(lambda: asyncio.run(noop_items(kind, items)), meter)
            if kind not in noop or wall / items < noop[kind][0]:
                noop[kind] = (wall / items, cpu / items)
    ray.shutdown()
    shutil.rmtree(ray_temp, ignore_errors=True)

    table = Table(title=f"τ oracle, retail, {tasks_n} episodes, concurrency 1 (best of {repeats}, interleaved)")
    for col in ("executor", "wall ms/episode", "CPU ms/episode", "no-op item: wall ms", "no-op item: CPU ms"):
        table.add_column(col, justify="right")
    for kind in executors:
        table.add_row(kind, f"{best[kind][0] * 1e3:.1f}", f"{best[kind][1] * 1e3:.1f}", f"{noop[kind][0] * 1e3:.2f}",
                      f"{noop[kind][1] * 1e3:.2f}")
    table.add_row("ray − local", f"{(best['ray'][0] - best['local'][0]) * 1e3:+.1f}",
                  f"{(best['ray'][1] - best['local'][1]) * 1e3:+.1f}",
                  f"{(noop['ray'][0] - noop['local'][0]) * 1e3:+.2f}", f"{(noop['ray'][1] - noop['local'][1]) * 1e3:+.2f}")
    console.print(table)
    return {"overhead_ms": (best["ray"][0] - best["local"][0]) * 1e3,
            "noop_overhead_ms": (noop["ray"][0] - noop["local"][0]) * 1e3}


def wire(root: Path, tasks_n: int, console: Console) -> None:
    """What one episode sends and gets back on Ray: pickled sizes and (de)serialisation times."""
    import ray.cloudpickle as cloudpickle

    from closedloop.evals.tau import load_domain
    from closedloop.evals.tau.orchestrator import load_user_guidelines
    from closedloop.evals.tau.runner import EpisodeRunner, EvalSettings, RemoteEpisode, episode_parts

    data = load_domain("retail", root)
    taskset = data.load_tasks("base")
    tasks = taskset.tasks[:tasks_n]
    settings = EvalSettings(name="wire", domain="retail", split="base", data_dir=str(root),
                            task_file_sha256=taskset.sha256, agent="oracle", workers=0)
    guidelines = load_user_guidelines(root)
    parts = episode_parts(settings)
    runner = EpisodeRunner(settings, data, agents=parts.agents, user_for=parts.user_for, guidelines=guidelines)

    async def episodes() -> list[Any]:
        return [await runner.episode(t, 0) for t in tasks]

    sims = asyncio.run(episodes())
    jobs = [RemoteEpisode(settings, ("retail", str(root), {}), guidelines, t, 0) for t in tasks]
    table = Table(title="over the wire, per episode (mean)")
    for col in ("message", "bytes", "pickle ms", "unpickle ms"):
        table.add_column(col, justify="right")
    for label, objs in (("RemoteEpisode (to the task)", jobs), ("SimulationRun (back)", sims)):
        t0 = time.perf_counter()
        blobs = [cloudpickle.dumps(o) for o in objs]
        t1 = time.perf_counter()
        for b in blobs:
            cloudpickle.loads(b)
        t2 = time.perf_counter()
        n = len(objs)
        table.add_row(label, f"{sum(map(len, blobs)) / n:,.0f}", f"{(t1 - t0) / n * 1e3:.2f}", f"{(t2 - t1) / n * 1e3:.2f}")
    console.print(table)


class SimulatedCluster:
    """Ray nodes on this host, each a ``ray start --block`` process group with its own temp dir,
    stopped by their own process ids (never ``ray stop``, which ends every Ray process on the host)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.env = dict(os.environ)  # RAY_AUTH_MODE/RAY_AUTH_TOKEN: main() sets them for every process
        self.dirs: list[str] = []
        self.head = self._start(["--head", "--port", str(self.port), "--num-cpus", "0", "--include-dashboard",
                                 "false", "--disable-usage-stats"])
        self.workers: list[subprocess.Popen] = []

    def _start(self, args: list[str]) -> subprocess.Popen:
        temp = tempfile.mkdtemp(prefix="clbn-")
        self.dirs.append(temp)
        return subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--temp-dir", temp,
                                 *args], env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def add_worker(self) -> None:
        self.workers.append(self._start(["--address", self.address, "--num-cpus", "1"]))

    def processes(self) -> list[psutil.Process]:
        out = []
        for p in [self.head, *self.workers]:
            try:
                root = psutil.Process(p.pid)
                out += [root, *root.children(recursive=True)]
            except psutil.Error:
                pass
        return out

    def stop(self) -> None:
        for group in [*reversed(self.workers), self.head]:  # workers first: they drain through the head
            if group.poll() is None:
                os.killpg(group.pid, signal.SIGTERM)
            try:
                group.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(group.pid, signal.SIGKILL)
                group.wait()
            try:
                os.killpg(group.pid, signal.SIGKILL)  # anything of that node still left
            except ProcessLookupError:
                pass
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def scaling(root: Path, tasks_n: int, nodes: list[int], store_dir: Path, console: Console) -> list[dict[str, float]]:
    import ray

    from closedloop.evals.harness import ExecutorConfig
    from closedloop.evals.harness.ray_executor import RayExecutor

    cluster = SimulatedCluster()
    rows = []
    try:
        for n in range(1, max(nodes) + 1):
            cluster.add_worker()
            if n not in nodes:
                continue
            deadline = time.monotonic() + 300
            while True:
                try:
                    ray.init(address=cluster.address, log_to_driver=False)
                    break
                except ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            while ray.cluster_resources().get("CPU", 0) < n:
                assert time.monotonic() < deadline, "the worker nodes never joined"
                time.sleep(0.5)
            executor = RayExecutor(ExecutorConfig(kind="ray"))
            asyncio.run(_eval(executor, root, n, n, store_dir, f"warm-{n}"))  # every node's worker up, domain loaded
            meter = CpuMeter()
            c0, k0, t0 = meter(), _cpu_of(cluster.processes()), time.perf_counter()
            ran = asyncio.run(_eval(executor, root, tasks_n, n, store_dir, f"scale-{n}"))
            wall = time.perf_counter() - t0
            cpu = meter() - c0 + _cpu_of(cluster.processes()) - k0
            ray.shutdown()
            rows.append({"nodes": n, "episodes_per_s": ran / wall, "wall_s": wall, "cpu_s": cpu,
                         "load": os.getloadavg()[0]})
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
    table = Table(title=f"τ oracle on Ray, {tasks_n} episodes; head (driver) + N one-CPU worker nodes on this "
                        f"{os.cpu_count()}-core host")
    for col in ("worker nodes", "episodes/s", "× 1 node", "wall s", "CPU s (all processes)", "load (1 min)"):
        table.add_column(col, justify="right")
    base = rows[0]["episodes_per_s"] if rows else 1.0
    for r in rows:
        table.add_row(str(r["nodes"]), f"{r['episodes_per_s']:.2f}", f"{r['episodes_per_s'] / base:.2f}",
                      f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", f"{r['load']:.1f}")
    console.print(table)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir")
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nodes", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--worker-niceness", type=int, default=0,
                    help="niceness of Ray's worker processes (Ray's own default is 15: on a shared host they then "
                         "yield to every other process, which a like-for-like comparison must not measure)")
    args = ap.parse_args()
    os.environ["RAY_worker_niceness"] = str(args.worker_niceness)  # read by every raylet this run starts
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # One token for every node and driver of this run (Ray reads it once per process).
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    root = _anchors(args.data_dir)
    console = Console(width=160)
    console.print(f"host: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start; Ray worker niceness "
                  f"{args.worker_niceness}")
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        overhead(root, args.tasks, args.repeats, Path(tmp), console)
        wire(root, args.tasks, console)
        if args.nodes:
            scaling(root, args.tasks, sorted(set(args.nodes)), Path(tmp), console)
    console.print(f"load {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
