"""The queued write path (``log_step``, ``StoreRecorder``): off the event loop, yet durable and visible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from closedloop.graphs.react import graph
from closedloop.messages import AssistantMessage, ToolCall, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.plugins import tool_registry
from closedloop.runtime import AgentContext
from closedloop.runtime.convert import role_of
from closedloop.runtime.execute import run_graph
from closedloop.runtime.recording import StoreRecorder
from closedloop.store import RunNotFoundError, RunStateError, RunStore
from closedloop.tool import ToolResult

from .conftest import REPO, make_turn, run_python
from .test_trajectories import _count_connections


async def test_graph_run_records_through_the_queue_without_opening_the_file(store: RunStore):
    client = ScriptedClient([AssistantMessage(tool_calls=[ToolCall.make("add", {"a": 3, "b": 4})]),
                             AssistantMessage(content="7")])
    context = AgentContext(client=client, tools=tool_registry(["arithmetic"]), max_turns=4)
    rid = store.start_run(kind="run", graph="react")
    opened: list[int] = []
    with _count_connections(store, opened):
        result = await run_graph(graph, {"messages": [UserMessage(content="3+4?")]}, context=context,
                                 recorder=StoreRecorder(store, rid))
    assert threading.get_ident() not in opened  # the event loop's thread never opened the DuckDB file
    store.finish_run(rid, outcome={"answer": "7"})
    rec = store.get_run(rid)
    assert [m.role for m in rec.messages] == ["user", "assistant", "tool", "assistant"]
    assert [m.role for m in rec.messages] == [role_of(m) for m in result.state["messages"]]
    assert len(rec.turns) == 2 and rec.turns[1].message.text == "7"
    [tc] = rec.tool_calls
    assert (tc.name, tc.turn_idx, tc.result) == ("add", 0, "7.0")


def test_queued_and_direct_writes_keep_their_order(store: RunStore):
    rid = store.start_run()
    t0, t1 = make_turn("first", tool="add", args={"a": 1}), make_turn("second")
    store.log_step(rid, [UserMessage(content="q")], [t0],
                   [(t0.message.tool_calls[0], ToolResult("add", "1"), None)])
    store.log_messages(rid, [t0.message])  # direct: commits the queue first
    store.log_step(rid, [UserMessage(content="again")], [t1])
    store.log_step(rid, [UserMessage(content="only this")], replace=True)
    rec = store.get_run(rid)  # reads see this process's queued writes
    assert [m.text for m in rec.messages] == ["only this"]
    assert [t.message.text for t in rec.turns] == ["first", "second"]
    assert rec.tool_calls[0].turn_idx == 0 and rec.prompt_tokens == 8 and rec.completion_tokens == 6


def test_a_queued_write_to_a_finished_run_is_reported_by_flush_and_spares_other_runs(store: RunStore):
    done, live = store.start_run(), store.start_run()
    store.finish_run(done)
    store.log_step(done, [UserMessage(content="late")])
    store.log_step(live, [UserMessage(content="fine")])
    store.log_step("no-such-run", [UserMessage(content="lost")])
    with pytest.warns(RuntimeWarning, match="dropped"), pytest.raises(RunStateError, match="is completed"):
        store.flush()
    store.flush()  # reported once
    assert [m.text for m in store.get_run(live).messages] == ["fine"]
    assert store.get_run(done).messages == []
    store.log_step("no-such-run", [UserMessage(content="lost")])
    with pytest.warns(RuntimeWarning), pytest.raises(RunNotFoundError):
        store.flush()


FAST_WRITER = """
import sys
from closedloop.messages import AssistantMessage, Turn, UserMessage
from closedloop.store import RunStore

store = RunStore(sys.argv[1], flush_interval_s=float(sys.argv[3]))
run_id = store.start_run(kind="train")
for i in range(int(sys.argv[2])):
    store.log_step(run_id, [UserMessage(content=f"u{i}")],
                   [Turn(message=AssistantMessage(content=f"a{i}"), prompt_ids=[i], completion_ids=[i, i])])
print(run_id, flush=True)
ending = sys.argv[4]
if ending == "finish":
    store.finish_run(run_id, outcome={"rewards": {"r": 1.0}})
elif ending == "close":
    store.close()
# "exit": nothing; interpreter exit commits the queue
"""


@pytest.mark.parametrize("ending", ["finish", "close", "exit"])
def test_queued_writes_are_durable_and_visible_to_another_process(store_path, ending):
    proc = run_python(FAST_WRITER, str(store_path), "40", "60", ending)  # the interval alone would never flush
    assert proc.returncode == 0, proc.stderr
    rec = RunStore(store_path).get_run(proc.stdout.strip())
    assert [m.text for m in rec.messages] == [f"u{i}" for i in range(40)]
    assert [t.completion_ids for t in rec.turns] == [[i, i] for i in range(40)]
    assert rec.completion_tokens == 80
    assert rec.status == ("completed" if ending == "finish" else "killed")  # exited without finishing


KILLED_FAST_WRITER = """
import os, signal, sys
from closedloop.messages import AssistantMessage, Turn, UserMessage
from closedloop.store import RunStore

store = RunStore(sys.argv[1], flush_interval_s=60)
run_id = store.start_run(kind="eval")
store.log_step(run_id, [UserMessage(content="committed")], [Turn(message=AssistantMessage(content="t0"))])
store.flush()
store.log_step(run_id, [UserMessage(content="still queued")])
print(run_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_queued_writer_is_marked_killed_with_what_it_committed(store_path):
    proc = run_python(KILLED_FAST_WRITER, str(store_path))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    rec = RunStore(store_path).get_run(proc.stdout.strip())
    assert rec.status == "killed" and "exited without finishing" in rec.error
    assert [m.text for m in rec.messages] == ["committed"] and [t.message.text for t in rec.turns] == ["t0"]


STEADY_FAST_WRITER = """
import os, sys, time
from closedloop.messages import AssistantMessage, Turn
from closedloop.store import RunStore

store = RunStore(sys.argv[1], flush_interval_s=0.02)
run_id = store.start_run(kind="train")
print(run_id, flush=True)
i = 0
while not os.path.exists(sys.argv[2]) and i < 3000:  # until the reader has seen the run mid-way
    store.log_step(run_id, turns=[Turn(message=AssistantMessage(content=str(i)), prompt_ids=[i], completion_ids=[i])])
    i += 1
    time.sleep(0.01)
store.finish_run(run_id)
print(i, flush=True)
"""


def test_another_process_reads_while_the_background_writer_commits(store_path, tmp_path):
    RunStore(store_path)
    flag = tmp_path / "seen"
    writer = subprocess.Popen([sys.executable, "-c", STEADY_FAST_WRITER, str(store_path), str(flag)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_id = writer.stdout.readline().strip()
        assert run_id, writer.stderr.read()
        reader = RunStore(store_path)
        seen = []
        while writer.poll() is None:
            rec = reader.get_run(run_id)
            assert rec.prompt_tokens == len(rec.turns)  # totals and rows commit together
            assert [t.message.text for t in rec.turns] == [str(i) for i in range(len(rec.turns))]
            seen.append((len(rec.turns), rec.status))
            if rec.turns and rec.status == "running":
                flag.touch()
            time.sleep(0.02)  # a reader polling as `runs show` would; a tight loop could starve the writer
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
    finally:
        if writer.poll() is None:
            writer.kill()
    n = int(out.strip())
    counts = [k for k, _ in seen]
    assert counts == sorted(counts) and any(k > 0 and status == "running" for k, status in seen), seen
    final = reader.get_run(run_id)
    assert final.status == "completed" and len(final.turns) == n


READ_MESSAGES = """
import sys
from closedloop.store import RunStore

print(len(RunStore(sys.argv[1]).get_run(sys.argv[2]).messages))
"""


def test_the_writer_keeps_the_file_open_between_batches_and_lets_a_waiting_process_in(store_path, monkeypatch):
    import closedloop.store.writer as writer_module

    monkeypatch.setattr(writer_module, "LINGER_S", 3600.0)  # only a process asking for the file makes it let go
    store = RunStore(store_path, flush_interval_s=0)
    run_id = store.start_run()
    logged, deadline = 0, time.monotonic() + 300
    while not store._file.holding():  # a batch the writer thread committed leaves the file open
        assert time.monotonic() < deadline, "the writer never kept the file open"
        store.log_step(run_id, [UserMessage(content=f"u{logged}")])
        logged += 1
        time.sleep(0.005)  # lets the writer thread take a batch; nothing races a clock
    store.flush()  # commits on the kept connection, which stays open
    assert store._file.holding()

    proc = run_python(READ_MESSAGES, str(store_path), run_id)  # waits for the lock, says so, gets it
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(logged)]  # every committed step, from the file itself
    assert not store._file.holding()

    store.log_step(run_id, [UserMessage(content="after")])  # the writer opens the file again
    store.finish_run(run_id)
    assert [m.text for m in RunStore(store_path).get_run(run_id).messages] == [f"u{i}" for i in range(logged)] + ["after"]
    store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_write_its_parents_queue_again(store_path):
    store = RunStore(store_path, flush_interval_s=60)
    rid = store.start_run()
    store.log_step(rid, [UserMessage(content="once")])
    pid = os.fork()
    if pid == 0:  # the child runs what a normal exit runs (the store's atexit flush), then leaves
        from closedloop.store.queued import _flush_at_exit

        try:
            _flush_at_exit()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    store.finish_run(rid)
    assert [m.text for m in store.get_run(rid).messages] == ["once"]


BOUNDED_WRITER = """
import os, signal, sys
from closedloop.messages import UserMessage
from closedloop.store import RunStore

store = RunStore(sys.argv[1], flush_interval_s=3600, max_queued_steps=4)  # only the bound makes it write
run_id = store.start_run()
print(run_id, flush=True)
for i in range(20):
    store.log_step(run_id, [UserMessage(content=f"u{i}")])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_queue_is_bounded_so_a_kill_loses_at_most_two_queues_of_steps(store_path):
    """What a SIGKILL can lose is bounded in steps, whatever the load: ``max_queued_steps`` waiting
    plus at most that many in the batch being written."""
    proc = run_python(BOUNDED_WRITER, str(store_path))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    texts = [m.text for m in RunStore(store_path).get_run(proc.stdout.strip()).messages]
    assert texts == [f"u{i}" for i in range(len(texts))] and len(texts) >= 20 - 2 * 4


ARROW_USER = """
import sys, threading
from closedloop.messages import AssistantMessage, Trajectory, Turn, UserMessage
from closedloop.store import RunStore

imported_on = []
sys.addaudithook(lambda event, args: event == "import" and args[0] in ("pyarrow", "pandas")
                 and imported_on.append((args[0], threading.current_thread().name)))
store = RunStore(sys.argv[1])
rid = store.start_run()
turn = Turn(message=AssistantMessage(content="a"), prompt_ids=[1, 2], completion_ids=[3])
store.log_messages(rid, [UserMessage(content="q")])
store.log_step(rid, [UserMessage(content="q")], [turn])
store.flush()
store.record_trajectory(Trajectory(messages=[UserMessage(content="q")], turns=[turn]))
store.log_metrics(rid, 0, {"loss": 1.0})
store.get_run(rid), store.list_runs(), list(store.iter_trajectories()), store.metrics(rid)
print("small", "pyarrow" in sys.modules, "pandas" in sys.modules, flush=True)
big = [Trajectory(messages=[UserMessage(content=f"q{i}")], turns=[turn]) for i in range(40)]
store.record_trajectories(big)  # 40 rows a table: worth Arrow, so it is warmed on its own thread
[warming] = [t for t in threading.enumerate() if t.name == "closedloop-arrow-import"] or [None]
if warming is not None:
    warming.join()
store.record_trajectories([t.model_copy(update={"id": t.id + "-2"}) for t in big])
print("big", sorted({name for name, _ in imported_on}), sorted({thread for _, thread in imported_on}), flush=True)
"""


def test_pyarrow_is_imported_only_for_large_writes_and_never_on_the_callers_thread(store_path):
    proc = run_python(ARROW_USER, str(store_path))
    assert proc.returncode == 0, proc.stderr
    small, big = proc.stdout.splitlines()
    assert small == "small False False"
    assert big.startswith("big ['pandas', 'pyarrow'] ") or big.startswith("big ['pyarrow'] ")
    assert big.endswith(" ['closedloop-arrow-import']")  # the caller's thread never paid the import
