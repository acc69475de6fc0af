"""The store across processes: SIGKILLed writers, crashes mid-transaction, readers beside writers."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import duckdb
import pytest

from closedloop.store import RunStore, StoreBusyError
from closedloop.store.process import pid_alive, process_start

from .conftest import KILLED_WRITER_IMPORT, REPO, run_python

KILLED_WRITER = KILLED_WRITER_IMPORT


def test_sigkilled_writer_shows_as_killed_with_its_turn(store_path):
    proc = run_python(KILLED_WRITER, str(store_path))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    run_id = proc.stdout.strip()

    store = RunStore(store_path)
    [summary] = store.list_runs()
    assert (summary.id, summary.status) == (run_id, "killed")
    assert "exited without finishing" in summary.error
    rec = store.get_run(run_id)
    assert [t.message.text for t in rec.turns] == ["partial"] and rec.turns[0].completion_ids == [3]
    assert [m.text for m in rec.messages] == ["hello"]
    assert rec.ended_at == rec.updated_at  # the last sign of life, not the time we noticed


# Dies inside the transaction of log_messages, after the first of three inserts.
CRASH_MID_WRITE = """
import os, signal, sys
import closedloop.store.writes as impl
from closedloop.messages import UserMessage
from closedloop.store import RunStore

store = RunStore(sys.argv[1])
run_id = store.start_run()
store.log_messages(run_id, [UserMessage(content="committed")])
print(run_id, flush=True)
original, count = impl._insert_message, [0]
def dying(*args):
    count[0] += 1
    if count[0] == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    original(*args)
impl._insert_message = dying
store.log_messages(run_id, [UserMessage(content=f"lost {i}") for i in range(3)])
"""


def test_crash_mid_transaction_leaves_no_partial_rows(store_path):
    proc = run_python(CRASH_MID_WRITE, str(store_path))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    rec = RunStore(store_path).get_run(proc.stdout.strip())
    assert [m.text for m in rec.messages] == ["committed"] and rec.status == "killed"


# Logs turns until the parent has seen the run mid-way (a flag file), then a few more.
STEADY_WRITER = """
import os, sys
from closedloop.messages import AssistantMessage, Turn
from closedloop.store import RunStore

store = RunStore(sys.argv[1])
flag, extra = sys.argv[2], 3
with store.run(kind="eval", graph="writer") as run:
    print(run.id, flush=True)
    i = 0
    while extra and i < 5000:
        run.log_turn(Turn(message=AssistantMessage(content=str(i)), prompt_ids=[i], completion_ids=[i]))
        i += 1
        extra -= os.path.exists(flag)
    run.outcome["turns"] = i
print(i, flush=True)
"""


def test_reader_in_another_process_while_writer_runs(store_path, tmp_path):
    """Issue 26 (1): this read failed under load with ``IO Error: Could not read enough bytes``
    (see test_concurrency.py for the cause and the stress version)."""
    RunStore(store_path)  # create the schema before the race starts
    flag = tmp_path / "seen-mid-run"
    writer = subprocess.Popen([sys.executable, "-c", STEADY_WRITER, str(store_path), str(flag)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_id = writer.stdout.readline().strip()
        assert run_id, writer.stderr.read()
        reader = RunStore(store_path)
        seen = []
        while writer.poll() is None:
            rec = reader.get_run(run_id)
            seen.append(len(rec.turns))
            assert rec.status in ("running", "completed")
            assert rec.prompt_tokens == len(rec.turns)  # run totals and turn rows commit together
            assert [t.message.text for t in rec.turns] == [str(i) for i in range(len(rec.turns))]
            if rec.turns and rec.status == "running":
                flag.touch()  # the writer finishes only after a read saw it mid-run
        out, err = writer.communicate(timeout=600)
        assert writer.returncode == 0, err
    finally:
        if writer.poll() is None:
            writer.kill()
    n = int(out.strip())
    assert seen == sorted(seen)  # each read saw a consistent, growing prefix
    assert any(0 < k < n for k in seen), seen
    final = reader.get_run(run_id)
    assert final.status == "completed" and len(final.turns) == n and final.outcome == {"turns": n}
    assert [t.message.text for t in final.turns] == [str(i) for i in range(n)]


HOLD_LOCK = """
import sys, time, duckdb
con = duckdb.connect(sys.argv[1])
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
con.close()
"""


def test_writer_waits_for_a_lock_holder_then_gives_up_clearly(store_path):
    RunStore(store_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(store_path), "1.5"], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreBusyError, match="locked"):
            RunStore(store_path, lock_timeout_s=0.2)
        t0 = time.monotonic()
        patient = RunStore(store_path, lock_timeout_s=30)  # retries until the holder lets go
        run_id = patient.start_run()
        assert time.monotonic() - t0 < 30 and patient.get_run(run_id).status == "running"
    finally:
        holder.kill()
        holder.wait()


def test_pid_alive_sees_zombies_and_reused_pids():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start(child.pid)
    deadline = time.monotonic() + 30
    while pid_alive(child.pid) and time.monotonic() < deadline:  # exits, but is not reaped: a zombie
        time.sleep(0.02)
    assert not pid_alive(child.pid)
    child.wait()
    assert not pid_alive(child.pid)

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        real = process_start(sleeper.pid)
        assert pid_alive(sleeper.pid, real)
        if real is not None:  # Linux: a different start time means the pid was reused
            assert not pid_alive(sleeper.pid, real - 1)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert start is None or isinstance(start, int)


def test_runs_of_other_hosts_are_left_alone(store_path):
    store = RunStore(store_path)
    run_id = store.start_run()
    with store._connect() as con:
        con.execute("UPDATE runs SET hostname = 'elsewhere', pid = 999999999 WHERE id = ?", [run_id])
    assert store.get_run(run_id).status == "running"
    with duckdb.connect(str(store_path)) as con:
        con.execute("UPDATE runs SET hostname = ? WHERE id = ?",
                    [socket.gethostname(), run_id])
    assert store.get_run(run_id).status == "killed"
