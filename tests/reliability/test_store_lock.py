"""Another process holding the run store: a clear one-line error naming it, and a configurable wait.

Issue 9 (15): when another process held the store for more than 15 s, an eval aborted with a
58-line traceback. Now the error names the holder (pid and command line) and says how to wait
longer; the CLI prints it as one line, without a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from closedloop.store import RunStore, StoreBusyError

# A process that opens the file and keeps it; its command line carries a marker we can look for.
_HOLDER = textwrap.dedent("""
    import sys, time, duckdb
    con = duckdb.connect(sys.argv[1])
    print("holding", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def holder(tmp_path: Path):
    db = tmp_path / "runs.duckdb"
    RunStore(db).close()  # a real, migrated store
    script = tmp_path / "hold_store.py"
    script.write_text(_HOLDER)
    proc = subprocess.Popen([sys.executable, str(script), str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        yield db, proc
    finally:
        proc.kill()
        proc.wait()


def test_the_error_names_the_holding_process(holder):
    db, proc = holder
    with pytest.raises(StoreBusyError) as info:
        RunStore(db, lock_timeout_s=0.2)
    err = info.value
    assert err.pid == proc.pid and "hold_store.py" in (err.command or "")
    message = str(err)
    assert "\n" not in message and f"pid {proc.pid}" in message and "CLOSEDLOOP_STORE_LOCK_TIMEOUT" in message
    assert "0.2 s" in message


def test_the_wait_comes_from_the_environment(holder, monkeypatch):
    db, _ = holder
    monkeypatch.setenv("CLOSEDLOOP_STORE_LOCK_TIMEOUT", "0.3")
    with pytest.raises(StoreBusyError) as info:
        RunStore(db)
    assert info.value.waited_s == pytest.approx(0.3)
    monkeypatch.setenv("CLOSEDLOOP_STORE_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CLOSEDLOOP_STORE_LOCK_TIMEOUT"):
        RunStore(db)


def test_the_cli_prints_one_line_and_no_traceback(holder):
    db, proc = holder
    env = {**os.environ, "CLOSEDLOOP_STORE": str(db), "CLOSEDLOOP_STORE_LOCK_TIMEOUT": "0.5"}
    out = subprocess.run([sys.executable, "-m", "closedloop", "runs", "list"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 75  # EX_TEMPFAIL: try again later
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"pid {proc.pid}" in lines[0] and "hold_store.py" in lines[0]


def test_a_wait_longer_than_the_hold_succeeds(tmp_path):
    db = tmp_path / "runs.duckdb"
    RunStore(db).close()
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER.replace("time.sleep(120)", "time.sleep(1.0)"), str(db)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    store = RunStore(db, lock_timeout_s=60)  # retries until the holder lets go
    assert store.list_runs() == []
    proc.wait()


_STORE_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from closedloop.store.lock import StoreLock
    with StoreLock(Path(sys.argv[1])).hold(shared=False, deadline=time.monotonic() + 60):
        print("holding", flush=True)
        time.sleep(120)
""")


def test_a_closedloop_process_holding_the_store_is_named_too(tmp_path):
    """The store's own lock (taken before DuckDB opens the file) names its holder the same way."""
    db = tmp_path / "runs.duckdb"
    RunStore(db).close()
    script = tmp_path / "long_export.py"
    script.write_text(_STORE_HOLDER)
    proc = subprocess.Popen([sys.executable, str(script), str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        with pytest.raises(StoreBusyError) as info:
            RunStore(db, lock_timeout_s=0.2).list_runs()
        assert "\n" not in str(info.value) and "CLOSEDLOOP_STORE_LOCK_TIMEOUT" in str(info.value)
        if Path("/proc/locks").exists():
            assert info.value.pid == proc.pid and "long_export.py" in (info.value.command or "")
    finally:
        proc.kill()
        proc.wait()
