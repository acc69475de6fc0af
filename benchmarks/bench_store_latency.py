"""How long a queued write (``RunStore.log_step``) waits until it is committed, with and without load.

The docs once promised 0.1 s (``flush_interval_s``); under load a commit took over a second. This
measures what bounds it: ``--steps`` steps are queued at a steady pace (a graph step every
``--pace`` seconds: a tool call, its result and the model turn), and for each one the time from
``log_step`` to the end of the transaction that committed it is recorded (the background writer's
``_write_steps`` is wrapped, nothing else changes). The same run is repeated beside ``--busy``
processes spinning on the CPU (0 = the machine as it is), so the report shows how the gathering
interval, the batch's own CPU work and the machine's load add up. Reported per level: the load
average, p50 / p99 / max latency, batches, and this process's CPU per step (all threads).

    python benchmarks/bench_store_latency.py --steps 300 --busy 0 4 8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


def measure(steps: int, pace: float, interval: float) -> dict[str, float]:
    from closedloop.messages import AssistantMessage, ToolCall, ToolMessage, Turn, Usage
    from closedloop.store import RunStore
    from closedloop.tool import ToolResult

    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(Path(tmp) / "runs.duckdb", flush_interval_s=interval)
        rid = store.start_run()
        submitted: dict[int, float] = {}
        latencies: list[float] = []
        batches = [0]
        write = store._write_steps

        def timed(batch: list[Any]) -> None:
            write(batch)
            done = time.monotonic()
            batches[0] += 1
            latencies.extend(done - submitted[id(s)] for s in batch if id(s) in submitted)

        store._write_steps = timed  # type: ignore[method-assign]
        enqueue = store._enqueue

        def stamped(step: Any) -> None:
            submitted[id(step)] = time.monotonic()
            enqueue(step)

        store._enqueue = stamped  # type: ignore[method-assign]
        c0 = time.process_time()
        for i in range(steps):
            call = ToolCall.make("add", {"a": i, "b": 1})
            turn = Turn(message=AssistantMessage(content=f"step {i}", tool_calls=[call]), prompt_ids=list(range(300)),
                        completion_ids=list(range(20)), usage=Usage(prompt_tokens=300, completion_tokens=20))
            store.log_step(rid, [turn.message, ToolMessage(tool_call_id=call.id, content=str(i + 1))], [turn],
                           [(call, ToolResult("add", str(i + 1)), None)])
            time.sleep(pace)
        store.flush()
        cpu = time.process_time() - c0
        store.close()
    latencies.sort()
    return {"p50_s": statistics.median(latencies), "p99_s": latencies[int(0.99 * (len(latencies) - 1))],
            "max_s": latencies[-1], "batches": batches[0], "cpu_us_per_step": cpu / steps * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--pace", type=float, default=0.01, help="seconds between two queued steps")
    ap.add_argument("--interval", type=float, default=0.1, help="the store's flush_interval_s")
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 4, 8], help="spinning processes beside the run")
    args = ap.parse_args()
    from closedloop.store.batch import arrow_ready

    arrow_ready(wait=True)  # its one-time import is not what this measures
    print(f"{'busy':>4} {'load1':>6} {'p50 s':>7} {'p99 s':>7} {'max s':>7} {'batches':>7} {'CPU us/step':>11}")
    for busy in args.busy:
        stop = mp.Event()
        spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
        for p in spinners:
            p.start()
        try:
            r = measure(args.steps, args.pace, args.interval)
            load = os.getloadavg()[0]
        finally:
            stop.set()
            for p in spinners:
                p.join()
        print(f"{busy:>4} {load:>6.1f} {r['p50_s']:>7.3f} {r['p99_s']:>7.3f} {r['max_s']:>7.3f} {r['batches']:>7} "
              f"{r['cpu_us_per_step']:>11.0f}")


if __name__ == "__main__":
    main()
