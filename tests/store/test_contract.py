"""Run-store contract: every backend (DuckDB file, DuckDB memory) must pass these."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import duckdb
import pytest

from closedloop.messages import SystemMessage, ToolCall, Trajectory, UserMessage
from closedloop.store import RunNotFoundError, RunStateError, RunStore, register_price
from closedloop.store.pricing import PRICES
from closedloop.tool import ToolResult, tool

from .conftest import make_turn


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def test_normal_run_round_trips_messages_turns_and_tool_calls(store: RunStore):
    t0 = make_turn("let me add", tool="add", args={"a": 2, "b": 3}, n_prompt=5, n_completion=4)
    call = t0.message.tool_calls[0]
    result = await add.run(call.function.arguments)
    t1 = make_turn("the answer is 5", offset=100, n_prompt=12, n_completion=6)
    with store.run(kind="eval", graph="react", model_spec="hf:tiny", config={"temperature": 0.0},
                   tags=["smoke"], metadata={"task": "t1"}) as run:
        run.log_messages([SystemMessage(content="be brief"), UserMessage(content="2+3?")])
        assert run.log_turn(t0) == 0
        assert run.log_tool_call(call, result) == 0
        run.log_messages([t0.message, result.to_message(call.id), t1.message])
        assert run.log_turn(t1) == 1
        run.outcome.update(answer="5", rewards={"exact": 1.0})

    rec = store.get_run(run.id)
    assert rec.status == "completed" and rec.kind == "eval" and rec.graph == "react"
    assert rec.ended_at is not None and rec.ended_at >= rec.started_at
    assert [m.role for m in rec.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert rec.messages[3].content == "5" and rec.messages[2].tool_calls[0].name == "add"
    assert [t.message.text for t in rec.turns] == ["let me add", "the answer is 5"]
    assert rec.turns[0].prompt_ids == t0.prompt_ids and rec.turns[0].completion_ids == t0.completion_ids
    assert rec.turns[0].logprobs == pytest.approx(t0.logprobs)
    assert rec.turns[1].loss_mask == [0] * 12 + [1] * 6
    assert rec.prompt_tokens == 17 and rec.completion_tokens == 10
    [tc] = rec.tool_calls
    assert (tc.name, tc.turn_idx, tc.call_id, tc.result, tc.error) == ("add", 0, call.id, "5", None)
    assert tc.latency_s == pytest.approx(result.latency_s)
    assert rec.outcome == {"answer": "5", "rewards": {"exact": 1.0}}
    assert rec.tags == ["smoke"] and rec.metadata == {"task": "t1"} and rec.config == {"temperature": 0.0}


def test_load_trajectory_is_token_exact(store: RunStore):
    turns = [make_turn("a", n_prompt=3, n_completion=2), make_turn("b", offset=0, n_prompt=7, n_completion=2)]
    turns[1].prompt_ids = turns[0].prompt_ids + turns[0].completion_ids + [7, 8]
    turns[1].loss_mask = None
    turns[1] = turns[1].model_validate(turns[1].model_dump(exclude={"loss_mask"}))
    with store.run(kind="train") as run:
        for t in turns:
            run.log_turn(t)
        run.outcome["rewards"] = {"task": 0.5}
        run.outcome["step_rewards"] = [None, 1.0]
    traj = store.load_trajectory(run.id)
    assert traj.id == run.id and traj.rewards == {"task": 0.5} and traj.step_rewards == [None, 1.0]
    original = Trajectory(turns=turns).token_view()
    assert [v.model_dump() for v in traj.token_view()] == [v.model_dump() for v in original]
    assert len(original) == 1  # the second prompt extends the first: one merged sequence


def test_failed_run_keeps_error_and_reraises(store: RunStore):
    with pytest.raises(ZeroDivisionError):
        with store.run(graph="g") as run:
            run.log_turn(make_turn())
            1 / 0
    rec = store.get_run(run.id)
    assert rec.status == "failed" and "ZeroDivisionError" in rec.error and len(rec.turns) == 1


def test_keyboard_interrupt_marks_interrupted(store: RunStore):
    with pytest.raises(KeyboardInterrupt):
        with store.run() as run:
            raise KeyboardInterrupt
    assert store.get_run(run.id).status == "interrupted"


async def test_cancelled_task_marks_interrupted(store: RunStore):
    started = asyncio.Event()
    holder = {}

    async def episode():
        async with store.run(kind="eval") as run:
            holder["id"] = run.id
            started.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(episode())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert store.get_run(holder["id"]).status == "interrupted"


def test_explicit_finish_and_state_errors(store: RunStore):
    rid = store.start_run(graph="g")
    store.finish_run(rid, "failed", outcome={"rewards": {"r": 0.0}}, error="judge unavailable")
    rec = store.get_run(rid)
    assert (rec.status, rec.error, rec.outcome) == ("failed", "judge unavailable", {"rewards": {"r": 0.0}})
    with pytest.raises(RunStateError):
        store.log_turn(rid, make_turn())
    with pytest.raises(RunStateError):
        store.finish_run(rid, "completed")
    with pytest.raises(ValueError):
        store.finish_run(store.start_run(), "running")
    with pytest.raises(RunNotFoundError):
        store.log_turn("nope", make_turn())
    with pytest.raises(RunNotFoundError):
        store.get_run("nope")
    with pytest.raises(RunStateError):
        store.start_run(run_id=rid)


def test_list_filters_and_orders_newest_first(store: RunStore):
    ids = []
    for i, (kind, graph, status) in enumerate([("eval", "react", "completed"), ("train", "react", "failed"),
                                               ("eval", "plan", "completed"), ("run", "react", None)]):
        rid = store.start_run(kind=kind, graph=graph, tags=[f"t{i}"])
        if status:
            store.finish_run(rid, status)
        ids.append(rid)
        time.sleep(0.002)
    assert [r.id for r in store.list_runs()] == ids[::-1]
    assert [r.id for r in store.list_runs(limit=2)] == ids[:1:-1]
    assert {r.id for r in store.list_runs(kind="eval")} == {ids[0], ids[2]}
    assert [r.id for r in store.list_runs(graph="react", status="completed")] == [ids[0]]
    assert [r.id for r in store.list_runs(status="running")] == [ids[3]]
    assert [r.id for r in store.list_runs(tag="t1")] == [ids[1]]
    assert store.list_runs(graph="nothing") == []


def test_get_run_accepts_unique_prefix(store: RunStore):
    a = store.start_run(run_id="abc111")
    store.start_run(run_id="abc222")
    assert store.get_run("abc1").id == a
    with pytest.raises(RunNotFoundError, match="ambiguous"):
        store.get_run("abc")


def test_replace_messages_rewrites_the_list(store: RunStore):
    rid = store.start_run()
    store.log_messages(rid, [UserMessage(content="one"), {"role": "assistant", "content": "two"}])
    store.log_messages(rid, [UserMessage(content="only")], replace=True)
    assert [m.text for m in store.get_run(rid).messages] == ["only"]


def test_failed_write_leaves_no_partial_rows(store: RunStore):
    """A logical write is one transaction: a failure after some inserts rolls all of them back."""
    rid = store.start_run()
    calls = {"n": 0}
    import closedloop.store.writes as impl

    original = impl._insert_message

    def flaky(con, run_id, idx, role, js):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk vanished")
        original(con, run_id, idx, role, js)

    impl._insert_message = flaky
    try:
        with pytest.raises(OSError):
            store.log_messages(rid, [UserMessage(content=str(i)) for i in range(4)])
    finally:
        impl._insert_message = original
    assert calls["n"] == 3 and store.get_run(rid).messages == []


def test_cost_from_price_table_and_usage(store: RunStore, monkeypatch):
    monkeypatch.setitem(PRICES, "unit-model", PRICES["gpt-4o"])
    register_price("unit-model", 1.0, 2.0)  # USD per million tokens
    rid = store.start_run(model_spec="openai:unit-model@http://localhost:8000/v1")
    store.log_turn(rid, make_turn(model="", n_prompt=1000, n_completion=500))  # priced through model_spec
    store.log_turn(rid, make_turn(model="unit-model-2025-01-01", n_prompt=2000, n_completion=0))  # dated variant
    store.log_turn(rid, make_turn(model="other", cost=0.5))  # the backend's own figure wins
    rec = store.get_run(rid)
    assert [t.usage.cost_usd for t in rec.turns] == pytest.approx([0.002, 0.002, 0.5])
    assert rec.cost_usd == pytest.approx(0.504)

    unknown = store.start_run(model_spec="hf:some/local-model")
    store.log_turn(unknown, make_turn(model="some/local-model"))
    rec = store.get_run(unknown)
    assert rec.cost_usd is None and rec.turns[0].usage.cost_usd is None and rec.prompt_tokens == 4


def test_record_trajectory_in_one_call(store: RunStore):
    traj = Trajectory(messages=[UserMessage(content="q")], turns=[make_turn("a"), make_turn("b", offset=9)],
                      rewards={"pass": 1.0}, metadata={"seed": 3})
    rid = store.record_trajectory(traj, graph="react", config={"lr": 1e-5})
    rec = store.get_run(rid)
    assert rid == traj.id and rec.status == "completed" and rec.kind == "train"
    assert [t.message.text for t in rec.turns] == ["a", "b"] and rec.metadata == {"seed": 3}
    assert store.load_trajectory(rid).rewards == {"pass": 1.0}


def test_record_trajectory_as_a_child_with_its_own_start_and_error(store: RunStore):
    from datetime import datetime

    parent = store.start_run(kind="eval", graph="react")
    start = datetime(2026, 1, 2, 3, 4, 5)
    rid = store.record_trajectory(Trajectory(turns=[make_turn("a")]), kind="episode", status="failed",
                                  parent_id=parent, started_at=start, error="user simulator: boom sk-abcdefghijklmnopqrstuv")
    rec = store.get_run(rid)
    assert rec.parent_id == parent and rec.started_at == start and rec.status == "failed"
    assert "boom" in rec.error and "sk-abcdefghijklmnopqrstuv" not in rec.error
    assert [r.id for r in store.list_runs(parent_id=parent)] == [rid]


def test_reopen_run_refuses_a_running_run_and_counts_attempts(store: RunStore):
    rid = store.start_run(kind="eval", config={"trials": 1})
    with pytest.raises(RunStateError):
        store.reopen_run(rid)
    store.finish_run(rid, "interrupted")
    store.reopen_run(rid, {"trials": 2})
    rec = store.get_run(rid)
    assert rec.status == "running" and rec.config == {"trials": 2} and rec.ended_at is None
    assert rec.metadata["attempts"] == 2 and rec.metadata["previous_status"] == ["interrupted"]
    store.finish_run(rid)
    store.reopen_run(rid)
    assert store.get_run(rid).config == {"trials": 2}  # kept when no new config is given


def test_export_parquet_reads_back(store: RunStore, tmp_path):
    with store.run(graph="react") as run:
        run.log_messages([UserMessage(content="hi")])
        t = make_turn(tool="add", args={"a": 1, "b": 1})
        run.log_turn(t)
        run.log_tool_call(t.message.tool_calls[0], ToolResult("add", "", error="boom", error_kind="exception", latency_s=0.1))
    paths = store.export_parquet(tmp_path / "pq")
    assert set(paths) == {"runs", "messages", "turns", "tool_calls", "metrics"}
    con = duckdb.connect()
    assert con.execute(f"SELECT id, status FROM '{paths['runs']}'").fetchall() == [(run.id, "completed")]
    assert con.execute(f"SELECT role FROM '{paths['messages']}'").fetchall() == [("user",)]
    ids, mask = con.execute(f"SELECT completion_ids, loss_mask FROM '{paths['turns']}'").fetchone()
    assert ids == t.completion_ids and list(mask) == t.loss_mask
    assert con.execute(f"SELECT error_kind, latency_s FROM '{paths['tool_calls']}'").fetchall() == [("exception", 0.1)]


def _backdate(store: RunStore, run_id: str, days: float) -> None:
    with store._connect() as con:
        con.execute("UPDATE runs SET started_at = started_at - to_microseconds(?::BIGINT), "
                    "updated_at = updated_at - to_microseconds(?::BIGINT), "
                    "ended_at = ended_at - to_microseconds(?::BIGINT) WHERE id = ?",
                    [int(days * 86400e6)] * 3 + [run_id])


def test_retention_deletes_old_finished_runs_and_children(store: RunStore):
    old = store.start_run()
    store.log_messages(old, [UserMessage(content="old")])
    store.log_turn(old, make_turn())
    store.log_tool_call(old, ToolCall.make("add", {}), ToolResult("add", "0"))
    store.finish_run(old, "failed")
    old_but_running = store.start_run()
    fresh = store.start_run()
    store.log_turn(fresh, make_turn())
    store.finish_run(fresh)
    _backdate(store, old, 40)
    _backdate(store, old_but_running, 100)
    _backdate(store, fresh, 10)

    assert store.delete_older_than(timedelta(days=45)) == 0
    assert store.delete_older_than(timedelta(days=30)) == 1
    assert {r.id for r in store.list_runs()} == {old_but_running, fresh}
    with store._connect() as con:
        for table in ("messages", "turns", "tool_calls"):
            assert con.execute(f"SELECT count(*) FROM {table} WHERE run_id = ?", [old]).fetchone()[0] == 0
    assert len(store.get_run(fresh).turns) == 1
    with pytest.raises(ValueError):
        store.delete_older_than(timedelta(seconds=-1))


def test_threads_writing_one_run_serialise_without_losing_rows(store: RunStore):
    """Conflicting transactions from threads (e.g. ``asyncio.to_thread`` tools) are retried whole."""
    import threading

    rid = store.start_run()
    errors = []

    def worker(w: int) -> None:
        try:
            for i in range(6):
                store.log_turn(rid, make_turn(f"{w}-{i}", n_prompt=2, n_completion=1))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rec = store.get_run(rid)
    assert sorted(t.message.text for t in rec.turns) == sorted(f"{w}-{i}" for w in range(4) for i in range(6))
    assert rec.prompt_tokens == 48 and rec.completion_tokens == 24
    with store._connect() as con:
        idx = [r[0] for r in con.execute("SELECT idx FROM turns WHERE run_id = ? ORDER BY idx", [rid]).fetchall()]
    assert idx == list(range(24))
