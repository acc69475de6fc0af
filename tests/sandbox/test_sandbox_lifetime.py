"""Sandboxed work does not outlive its caller, runs on a clock of its own, and leaves nothing on
disk once the next caller starts; a forged or nested result never crashes the caller.

Each lifetime test starts a real caller process (``sandbox_caller.py``), waits until the
sandboxed target says it started (a marker file with its host PID), then kills or stops the
caller. The waits below are for events, with generous bounds for a loaded machine; nothing
races a fixed sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from closedloop.sandbox import SandboxLimits, bounded_json_loads, reap_stale, run_sandboxed

from .test_sandbox import _alive

HERE = Path(__file__).parent
MODES = ["spawn", "fork"]


def _wait_for(cond, what: str, bound_s: float = 120.0) -> None:
    end = time.monotonic() + bound_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"still waiting after {bound_s:g} s for {what}")
        time.sleep(0.05)


def _start_caller(mode: str, tmp_path: Path, wall_s: float = 600.0):
    marker, out = tmp_path / "started.json", tmp_path / "out.txt"
    caller = subprocess.Popen([sys.executable, str(HERE / "sandbox_caller.py"), mode, str(marker), str(out),
                               str(wall_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(lambda: marker.exists() or caller.poll() is not None, "the sandboxed target to start")
    if not marker.exists():
        pytest.fail(f"the caller exited first: {caller.communicate()}")
    info = json.loads(marker.read_text())
    return caller, info["pid"], Path(info["cwd"]).parent


def _owned_by(pid: int) -> list[str]:
    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("closedloop-") and f"-{pid}." in n]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_caller_takes_its_sandbox_along(mode, sig, tmp_path):
    caller, target, root = _start_caller(mode, tmp_path)
    assert _alive(target) and root.is_dir() and _owned_by(caller.pid)
    caller.send_signal(sig)
    caller.wait()
    _wait_for(lambda: not _alive(target), "the sandboxed target to die with its caller")
    out = tmp_path / "out.txt"
    size = out.stat().st_size
    assert size > 0  # it was writing until then ...
    reap_stale(force=True)  # ... and the next start removes what the dead caller left on disk
    assert not root.exists()
    assert _owned_by(caller.pid) == []
    assert out.stat().st_size == size  # nothing wrote after its death


@pytest.mark.parametrize("mode", MODES)
def test_wall_clock_holds_inside_the_sandbox_when_the_caller_hangs(mode, tmp_path):
    """The caller is stopped (SIGSTOP: it cannot enforce anything); the supervisor in the sandbox
    still ends the work once ``wall_s`` plus its grace has passed."""
    caller, target, _ = _start_caller(mode, tmp_path, wall_s=1.0)
    os.kill(caller.pid, signal.SIGSTOP)
    try:
        _wait_for(lambda: not _alive(target), "the in-sandbox wall clock to end the target")
    finally:
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait()
        reap_stale(force=True)


def test_reaping_spares_the_living(tmp_path):
    mine = Path(tempfile.mkdtemp(prefix=f"closedloop-sandbox-{os.getpid()}.{os.stat('/proc/self/ns/pid').st_ino}-"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ghost = Path(tempfile.mkdtemp(prefix=f"closedloop-kbuild-{int(dead.stdout)}.{os.stat('/proc/self/ns/pid').st_ino}-"))
    other_ns = Path(tempfile.mkdtemp(prefix=f"closedloop-sandbox-{int(dead.stdout)}.1-"))
    try:
        removed = reap_stale(force=True)
        assert str(ghost) in removed and not ghost.exists()
        assert mine.exists() and other_ns.exists()  # alive, or from another PID namespace: kept
    finally:
        for d in (mine, ghost, other_ns):
            if d.exists():
                os.rmdir(d)


@pytest.mark.parametrize("mode", MODES)
def test_forged_nested_result_is_an_error_not_a_crash(mode):
    lim = SandboxLimits(python_path=[str(HERE)] + sys.path, wall_s=60)
    preload = ["json"] if mode == "fork" else None
    deep = 200_000
    for text in ("[" * deep + "]" * deep,
                 json.dumps({"status": "ok", "value_json": "[" * deep + "]" * deep}),
                 json.dumps({"status": "ok", "value_json": "[" * 100 + "]" * 100})):
        res = run_sandboxed("sandbox_targets:forge_result", text, limits=lim, preload=preload)
        assert res.status == "error" and res.error_type == "InvalidResult", res
        assert "nested" in res.error_message


def test_bounded_json_loads():
    assert bounded_json_loads('{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    assert bounded_json_loads("[" * 5 + "]" * 5, max_depth=5) == [[[[[]]]]]
    with pytest.raises(ValueError, match="deeper"):
        bounded_json_loads("[" * 6 + "]" * 6, max_depth=5)
    with pytest.raises(ValueError):
        bounded_json_loads("[" * 1_000_000 + "]" * 1_000_000)
