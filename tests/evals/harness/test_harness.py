"""The generic evaluation runner: concurrency, resource slots, timeouts, writes, claims."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from closedloop.evals.harness import (BatchRunner, EvalBusyError, EvalClaim, ResourceSlots, plan_remaining,
                                      settings_differences)


async def test_concurrency_and_resource_slots():
    active = {"all": 0, "dev": 0}
    peak = {"all": 0, "dev": 0}

    async def work(i: int) -> int:
        kinds = ["all"] + (["dev"] if i % 2 == 0 else [])
        for k in kinds:
            active[k] += 1
            peak[k] = max(peak[k], active[k])
        await asyncio.sleep(0.05)
        for k in kinds:
            active[k] -= 1
        return i

    written: list[int] = []
    runner = BatchRunner(work, written.append, concurrency=4, slots=ResourceSlots({"dev": 1}),
                         resource_of=lambda i: "dev" if i % 2 == 0 else None)
    assert await runner.run(list(range(12))) == 12
    assert sorted(written) == list(range(12))
    assert peak["all"] > 1 and peak["dev"] == 1


async def test_item_timeout_and_errors_become_results():
    async def work(i: int) -> str:
        if i == 1:
            await asyncio.sleep(10)
        if i == 2:
            raise RuntimeError("harness broke")
        return "graded"

    out: list[str] = []
    runner = BatchRunner(work, out.append, concurrency=3, item_timeout_s=0.2,
                         on_timeout=lambda i, e: "timeout", on_error=lambda i, e: f"infra_error:{e}")
    await runner.run([0, 1, 2])
    assert sorted(out) == ["graded", "infra_error:harness broke", "timeout"]


async def test_cancel_keeps_finished_results_and_drops_in_flight():
    def write(r: int) -> None:
        time.sleep(0.05)
        out.append(r)

    fourth_started = asyncio.Event()

    async def work(i: int) -> int:
        if i == 3:
            fourth_started.set()
            await asyncio.Event().wait()  # in flight until cancelled
        return i

    out: list[int] = []
    runner = BatchRunner(work, write, concurrency=1)
    task = asyncio.ensure_future(runner.run(list(range(6))))
    await fourth_started.wait()  # items 0-2 are finished (the last one's write may still be under way)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert out == [0, 1, 2]  # finished ones landed, nothing half-done or repeated


def test_plan_and_settings_helpers():
    assert plan_remaining([("a", 0), ("b", 0), ("a", 1)], {("a", 0)}, key=lambda x: x) == [("b", 0), ("a", 1)]
    assert settings_differences({"seed": 1, "model": "m"}, {"seed": 2, "model": "m"}, ["seed", "model"]) == {"seed": (1, 2)}


HOLD = textwrap.dedent("""
    import sys, time
    from closedloop.evals.harness import EvalClaim, EvalBusyError
    try:
        EvalClaim(sys.argv[1], sys.argv[2]).acquire()
    except EvalBusyError:
        print("refused", flush=True)
        sys.exit(3)
    print("claimed", flush=True)
    time.sleep(float(sys.argv[3]))
""")


def _hold(store: str, name: str, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, store, name, str(seconds)], stdout=subprocess.PIPE, text=True)
    return p


def test_claim_refused_while_live_and_taken_over_when_dead(tmp_path):
    store = str(tmp_path / "runs.duckdb")
    holder = _hold(store, "ev", 60)
    assert holder.stdout.readline().strip() == "claimed"
    with pytest.raises(EvalBusyError, match=f"pid {holder.pid}"):
        EvalClaim(store, "ev").acquire()
    EvalClaim(store, "other-name").acquire().release()  # names are independent
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with EvalClaim(store, "ev") as claim:  # the dead holder's claim is taken over
        assert claim.holder()["pid"] == os.getpid()


def test_claim_is_atomic_under_a_race(tmp_path):
    store = str(tmp_path / "runs.duckdb")
    procs = [_hold(store, "race", 2.0) for _ in range(4)]
    outs = [p.communicate()[0].strip() for p in procs]
    assert outs.count("claimed") == 1 and outs.count("refused") == 3
