"""The same containment tests as ``test_sandbox.py``, with every call forked from a fork server
that preloaded torch (``preload=``), plus what is specific to the fork server."""

from __future__ import annotations

import functools
import time

import pytest

import closedloop.sandbox as sandbox

from . import test_sandbox as base
from .test_sandbox import *  # noqa: F401,F403  - the tests themselves, run again here

PRELOAD = ["torch"]


@pytest.fixture(autouse=True)
def _forked(monkeypatch):
    """Route the shared tests' calls through the fork server."""
    monkeypatch.setattr(base, "run_sandboxed", functools.partial(sandbox.run_sandboxed, preload=PRELOAD))
    monkeypatch.setattr(base, "arun_sandboxed", functools.partial(sandbox.arun_sandboxed, preload=PRELOAD))


def test_each_call_is_a_fresh_single_use_child():
    a = base.run("add", 1)
    b = base.run("add", 2)
    assert a.status == b.status == "ok"
    assert a.value["cwd"] != b.value["cwd"]
    server = next(s for k, s in sandbox._SERVERS.items() if k[0] == tuple(PRELOAD))
    assert server.info["threads"] == 1  # forking a multi-threaded zygote would be unsafe
    assert server.proc.poll() is None  # the zygote outlives its children


def test_target_cannot_reach_the_zygote():
    """The child closes every inherited descriptor before the target runs: the control socket
    is gone, so a target cannot ask the zygote to fork an unconfined process."""
    res = base.run("open_fds")
    assert res.status == "ok", res
    assert res.value == [0, 1, 2]


def test_crash_and_timeout_leave_the_server_serving():
    assert base.run("segfault").status == "crashed"
    assert base.run("sleep_forever", lim=base.limits(wall_s=0.5)).status == "timeout"
    assert base.run("add", 5).value["sum"] == 5


def test_preload_of_a_missing_module_is_a_clear_error():
    with pytest.raises(RuntimeError, match="fork server failed to start"):
        sandbox.run_sandboxed(base.T + "add", 1, limits=base.limits(), preload=["no_such_module_xyz"])


def test_without_namespaces_the_forked_child_is_still_limited_and_killed(monkeypatch, tmp_path):
    """Where user namespaces are unavailable the child runs the target itself (no PID-1 waiter):
    results, crashes and the wall clock behave the same, and the notes say what is missing."""
    monkeypatch.setattr(sandbox, "_unshare_works", lambda: False)
    res = base.run("add", 4)
    assert res.status == "ok" and res.value["sum"] == 4
    assert res.enforced["pid_namespace"] is False and any("network not isolated" in n for n in res.notes)
    seg = base.run("segfault")
    assert seg.status == "crashed" and seg.signal == "SIGSEGV"
    marker = tmp_path / "late.txt"
    late = base.run("spin_then_write", str(marker), 2.0, lim=base.limits(wall_s=0.5, writable_paths=[str(tmp_path)]))
    assert late.status == "timeout"
    time.sleep(2.5)
    assert not marker.exists()
