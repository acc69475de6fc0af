"""A tool timeout stops the work (process isolation) or at least cannot starve anything (threads).

Issue 9 (2): a timed-out tool kept running on the default thread pool, ``closedloop run`` could
not exit until it ended, and after six abandoned calls even ``add`` timed out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from closedloop import plugins
from closedloop.tool import Tool, ToolDefinitionError, tool

# Run in a child interpreter: whether the process can exit is the thing under test.
_THREADS = textwrap.dedent("""
    import asyncio, sys, time
    from closedloop.tool import still_running, tool
    from closedloop.tools.arithmetic import add

    @tool(timeout_s=0.2)
    def stuck(seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    async def main():
        # saturate what the default executor would have had on this machine, and more
        workers = min(32, (__import__("os").cpu_count() or 1) + 4)
        results = await asyncio.gather(*[stuck.run({"seconds": 600}) for _ in range(6)])
        assert all(r.error_kind == "timeout" for r in results), results
        results = [await stuck.run({"seconds": 600}) for _ in range(workers)]
        print("refused", sum(r.error_kind == "resource_limit" for r in results), "still", still_running())
        r = await add.run({"a": 1, "b": 2})
        print("add", r.content, r.error_kind)
        loop = asyncio.get_running_loop()
        r = await loop.run_in_executor(None, lambda: 42)  # the default pool is untouched too
        print("pool", r)

    asyncio.run(main())
    print("exiting now", flush=True)
""")


def test_abandoned_thread_calls_neither_starve_add_nor_block_exit(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(_THREADS)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert lines["add"] == "3.0 None" and lines["pool"] == "42" and lines["exiting"] == "now"
    refused, still = lines["refused"].split(" still ")
    # the accounting: the six abandoned calls are still running, so further calls of that tool are
    # refused (MAX_STILL_RUNNING) instead of piling up threads; other tools are unaffected
    assert int(still) == 6 and int(refused) >= 5


def test_a_thread_call_that_ends_late_is_no_longer_counted():
    import asyncio
    import threading

    gate = threading.Event()

    @tool(timeout_s=0.05)
    def waits(x: int) -> int:
        """Wait until released: the timeout is the subject, so the work cannot end before it."""
        gate.wait()
        return x

    async def main():
        assert (await waits.run({"x": 1})).error_kind == "timeout"
        assert waits.still_running == 1
        gate.set()
        guard = time.monotonic() + 600  # only against a hung run: the thread ends once released
        while waits.still_running and time.monotonic() < guard:
            await asyncio.sleep(0.01)
        assert waits.still_running == 0
        assert (await waits.run({"x": 2})).content == "2"

    asyncio.run(main())


_MODULE = textwrap.dedent('''
    import os, time
    from pathlib import Path
    from closedloop.tool import tool

    @tool(isolation="process", timeout_s=1.0)
    def spin() -> int:
        """Busy-loop forever: however slowly the process starts, the timeout ends it."""
        n = 0
        while True:
            n += 1

    @tool(isolation="process", timeout_s=None)
    def hold(started: str, release: str) -> int:
        """Say it started, then wait for the test's release (no timeout: nothing races)."""
        Path(started).write_text(str(os.getpid()))
        while not Path(release).exists():
            time.sleep(0.01)
        return 0

    @tool(isolation="process", memory_mb=300, timeout_s=None)
    def hog(mb: int) -> int:
        """Allocate mb MiB."""
        return len(bytearray(mb * 2**20))

    @tool(isolation="process", timeout_s=None)
    def fails(x: int) -> int:
        """Raise."""
        raise ValueError(f"bad x {x}")
''')


@pytest.fixture
def proc_tools(tmp_path, monkeypatch):
    (tmp_path / "rt_proc_tools.py").write_text(_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLOSEDLOOP_TEST_MARK", uuid.uuid4().hex)  # sandboxed tools inherit CLOSEDLOOP_*
    import importlib

    return importlib.import_module("rt_proc_tools")


def _marked() -> list[int]:
    """Live processes carrying this test's mark in their environment (sandboxed calls, any depth)."""
    mark = f"CLOSEDLOOP_TEST_MARK={os.environ['CLOSEDLOOP_TEST_MARK']}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return pids


async def _until_no_marked_process() -> list[int]:
    import asyncio

    guard = time.monotonic() + 120  # a killed process is gone in milliseconds; a live one never goes
    while (left := _marked()) and time.monotonic() < guard:
        await asyncio.sleep(0.05)
    return left


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
async def test_the_process_scan_sees_a_running_sandboxed_call(proc_tools, tmp_path):
    """The control for the test below: a call that signalled it started is found by the scan."""
    import asyncio

    started, release = tmp_path / "started", tmp_path / "release"
    call = asyncio.ensure_future(proc_tools.hold.run({"started": str(started), "release": str(release)}))
    while not started.exists():
        await asyncio.sleep(0.01)
    assert _marked(), "the scan cannot see sandboxed calls: the kill test below would prove nothing"
    release.touch()
    assert (await call).content == "0"
    assert await _until_no_marked_process() == []


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
async def test_process_isolation_kills_the_work_on_timeout(proc_tools):
    """The timeout is the subject and the work never ends: whether the child got as far as the
    loop or was still starting (at load 16 it may be), nothing of it may outlive the timeout."""
    r = await proc_tools.spin.run({})
    assert r.error_kind == "timeout" and "killed" in r.error
    assert await _until_no_marked_process() == []


async def test_process_isolation_enforces_the_memory_ceiling_and_reports_errors(proc_tools):
    r = await proc_tools.hog.run({"mb": 2000})
    assert r.error_kind == "resource_limit" and "300 MiB" in r.error
    assert (await proc_tools.hog.run({"mb": 10})).content == str(10 * 2**20)
    r = await proc_tools.fails.run({"x": 3})
    assert r.error_kind == "exception" and "ValueError: bad x 3" in r.error


def test_isolation_is_declared_and_checked():
    def local(x: int) -> int:
        return x

    with pytest.raises(ToolDefinitionError, match="module level"):
        Tool(local, isolation="process")
    assert Tool(local).isolation == "thread"  # a sync tool never blocks the loop unless its author says so
    inline = Tool(local, isolation="inline")  # declared trivial (arithmetic): called on the loop, no thread hop
    import asyncio

    assert asyncio.run(inline.run({"x": 3})).content == "3"
    with pytest.raises(ToolDefinitionError, match="an async function runs inline or in a process"):

        async def coro(x: int) -> int:
            return x

        Tool(coro, isolation="thread")


def test_heavy_paper_tools_default_to_process_isolation_with_a_memory_ceiling():
    registry = plugins.tool_registry()
    heavy = {"pc_bp_alignment", "pc_linear_equilibrium_check", "pc_width_sweep", "grid_mesh_operators",
             "hodge_spectrum", "project_to_compatible", "conditional_krr_fit", "residual_kernel_spectrum",
             "spike_attention_density_bias", "arbg_toy"}
    assert {t.name for t in registry if t.isolation == "process"} >= heavy
    assert all(t.memory_mb >= 1 for t in registry)  # every tool has a ceiling
