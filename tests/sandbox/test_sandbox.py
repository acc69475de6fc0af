"""The sandbox contains misbehaving targets: each ends with a clear status, the caller goes on."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from pathlib import Path

import pytest

from closedloop.sandbox import SandboxLimits, SandboxResult, arun_sandboxed, isolation_available, run_sandboxed

HERE = str(Path(__file__).parent)
T = "sandbox_targets:"


def limits(**kw) -> SandboxLimits:
    kw.setdefault("python_path", [HERE] + sys.path)
    kw.setdefault("wall_s", 20)
    return SandboxLimits(**kw)


def run(name: str, *args, lim: SandboxLimits | None = None, **kwargs) -> SandboxResult:
    return run_sandboxed(T + name, *args, limits=lim or limits(), **kwargs)


def test_ok_value_env_scrubbed_and_tmpdir_removed(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    res = run("add", 2, b=3, lim=limits(env={"KEEP_ME": "1"}))
    assert res.status == "ok", res
    assert res.value["sum"] == 5
    assert "SECRET_TOKEN" not in res.value["env"] and "KEEP_ME" in res.value["env"]
    assert res.value["home"] == res.value["cwd"]
    assert not Path(res.value["cwd"]).exists()  # removed afterwards
    assert res.enforced["memory"] and res.enforced["cpu"] and res.enforced["open_files"]
    assert res.cpu_s is not None and res.cpu_s > 0


def test_async_target_and_tool_target():
    assert run("async_mul", 6, 7).value == 42
    res = run_sandboxed("closedloop.tools.arithmetic:add", 1.5, 2.0)  # a Tool: its .fn is called
    assert res.status == "ok" and res.value == 3.5


def test_exception_is_structured():
    res = run("boom", "bad thing")
    assert res.status == "error" and res.error_type == "ValueError" and res.error_message == "bad thing"
    assert "boom" in res.traceback_tail


def test_non_json_return_and_bad_target():
    assert run("not_json").status == "error"
    res = run("no_such_function")
    assert res.status == "error" and res.error_type == "AttributeError"
    with pytest.raises(ValueError, match="package.module:function"):
        run_sandboxed("no_colon")
    with pytest.raises(ValueError, match="JSON"):
        run_sandboxed(T + "add", object())


def test_infinite_loop_hits_cpu_limit():
    res = run("loop_forever", lim=limits(cpu_s=1, wall_s=30))
    assert res.status == "killed" and "CPU" in res.error_message


def test_wall_clock_timeout_kills_the_work(tmp_path):
    marker = tmp_path / "late.txt"
    res = run("spin_then_write", str(marker), 2.0, lim=limits(wall_s=0.5, writable_paths=[str(tmp_path)]))
    assert res.status == "timeout"
    time.sleep(2.5)
    assert not marker.exists()  # the work stopped; nothing kept writing after the timeout


def test_segfault_and_abort_are_crashes():
    res = run("segfault")
    assert res.status == "crashed" and res.signal == "SIGSEGV"
    assert run("abort").status == "crashed"


def test_self_kill_reported():
    res = run("self_kill")
    assert res.status == "killed" and res.signal == "SIGKILL"


def test_memory_limit():
    res = run("allocate", lim=limits(memory_mb=512))
    assert res.status == "memory_exceeded"


def test_output_truncated():
    res = run("shout", 100_000, lim=limits(output_bytes=1000))
    assert res.status == "ok" and len(res.stdout) < 1200 and "[truncated" in res.stdout


def test_file_size_limit(tmp_path):
    res = run("big_file", "big.bin", 3, lim=limits(file_size_mb=1))
    assert res.status in ("killed", "error") and res.status != "ok"


def test_leftover_thread_does_not_hang():
    res = run("leave_thread", lim=limits(wall_s=10))
    assert res.status == "ok" and res.value == "returned"


@pytest.mark.skipif(not isolation_available()["network"], reason="no user namespaces here")
def test_no_network():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        res = run("open_socket", "127.0.0.1", port)
    finally:
        srv.close()
    assert res.status == "error" and res.error_type in ("ConnectionRefusedError", "OSError", "PermissionError", "TimeoutError")
    assert res.enforced["network"] is True


def test_network_allowed_when_asked():
    res = run("open_socket", "127.0.0.1", 9, lim=limits(network=True))
    assert res.enforced["network"] is False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not isolation_available()["pid_namespace"], reason="no user namespaces here")
def test_fork_bomb_contained(tmp_path):
    pid_file = tmp_path / "pids"
    res = run("fork_bomb", 200, str(pid_file), lim=limits(processes=32, wall_s=15, writable_paths=[str(tmp_path)]))
    assert res.status in ("ok", "timeout")
    if res.enforced.get("processes"):
        assert res.value.startswith("refused after")
    time.sleep(0.5)
    pids = [int(x) for x in pid_file.read_text().split()] if pid_file.exists() else []
    assert pids and not [p for p in pids if _alive(p)]  # every process died with the sandbox


@pytest.mark.skipif(not isolation_available()["pid_namespace"], reason="no user namespaces here")
def test_setsid_grandchild_dies_with_the_sandbox(tmp_path):
    marker = tmp_path / "escaped.txt"
    res = run("escape_group", str(marker), lim=limits(writable_paths=[str(tmp_path)]))
    assert res.status == "ok"
    time.sleep(2.0)
    assert not marker.exists()


def test_writes_outside_confined(tmp_path):
    outside = tmp_path / "outside.txt"
    res = run("write_file", str(outside))
    if not res.enforced.get("filesystem"):
        pytest.skip("Landlock unavailable: " + "; ".join(res.notes))
    assert res.status == "error" and res.error_type == "PermissionError"
    assert not outside.exists()
    assert run("write_file", "inside.txt").value == "written"  # its own directory stays writable


async def test_async_cancel_kills_the_process_group(tmp_path):
    marker = tmp_path / "late.txt"
    task = asyncio.create_task(arun_sandboxed(T + "spin_then_write", str(marker), 2.0,
                                              limits=limits(writable_paths=[str(tmp_path)])))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(2.5)
    assert not marker.exists()


async def test_async_runs_concurrently_and_times_out():
    results = await asyncio.gather(arun_sandboxed(T + "async_mul", 2, 3, limits=limits()),
                                   arun_sandboxed(T + "sleep_forever", limits=limits(wall_s=0.5)))
    assert results[0].value == 6 and results[1].status == "timeout"
