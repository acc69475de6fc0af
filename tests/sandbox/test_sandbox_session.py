"""Sessions (``open_sandboxed``): a sandboxed target the caller talks to over a private channel
and inspects through ``/proc``, in both the spawn and fork-server modes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from closedloop.sandbox import SandboxLimits, open_sandboxed, process_tree, task_count

HERE = str(Path(__file__).parent)


def limits(**kw) -> SandboxLimits:
    kw.setdefault("python_path", [HERE] + sys.path)
    kw.setdefault("wall_s", 60)
    return SandboxLimits(**kw)


@pytest.fixture(params=["spawn", "fork"])
def preload(request):
    return ["json"] if request.param == "fork" else None


async def test_session_talks_over_its_channel_and_returns(preload):
    async with open_sandboxed("sandbox_targets:channel_echo", limits=limits(), preload=preload) as s:
        f = s.channel.makefile("rwb")
        f.write(b"hello\npid\n")
        f.flush()
        assert f.readline() == b"HELLO\n"
        target = int(f.readline())
        tree = process_tree(s.pid)
        assert s.pid in tree and target in tree
        assert task_count(target) >= 1
        f.write(b"again\n")
        f.flush()
        assert f.readline() == b"AGAIN\n"
        f.close()
        s.channel.shutdown(2)  # EOF: the target returns
        res = await s.result()
    assert res.status == "ok" and res.value == 2, res
    assert process_tree(target) == []


async def test_session_wall_clock_and_kill_on_exit(preload):
    async with open_sandboxed("sandbox_targets:channel_then_sleep", limits=limits(wall_s=1), preload=preload) as s:
        target = int(s.channel.makefile("rb").readline())
        res = await s.result()
    assert res.status == "timeout"
    assert process_tree(target) == []
    async with open_sandboxed("sandbox_targets:channel_then_sleep", limits=limits(), preload=preload) as s:
        target = int(s.channel.makefile("rb").readline())
    assert process_tree(target) == []  # leaving the block ended it
