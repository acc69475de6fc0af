"""Trainer-grade trajectories: new Turn fields round-trip, bulk writes, reading many back in few queries."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import duckdb
import pytest

from closedloop.messages import LogprobSpec, SystemMessage, ToolMessage, Trajectory, UserMessage
from closedloop.store import RunStateError, RunStore, schema
from closedloop.store.schema import migrate

from .conftest import make_turn


def _helper_turn():
    t = make_turn("candidates: a, b", n_prompt=5, n_completion=4)
    return t.model_copy(update={"logprob_spec": LogprobSpec(mode="processed", temperature=0.7, top_p=0.9, backend="vllm"),
                                "trainable": False, "purpose": "propose_goals",
                                "unavailable": {"logprobs": "server returned none", "token_ids": "n/a"}})


def _episode(task: str, reward: float | None, *, n_turns: int = 2, seed: int = 0) -> Trajectory:
    messages = [SystemMessage(content="sys"), UserMessage(content=f"task {task}")]
    turns = []
    for i in range(n_turns):
        t = make_turn(f"{task}-{seed}-{i}", tool="add", args={"a": i, "b": seed}, offset=10 * i)
        turns.append(t)
        messages += [t.message, ToolMessage(tool_call_id=t.message.tool_calls[0].id, name="add", content=str(i))]
    return Trajectory(messages=messages, turns=turns, rewards={} if reward is None else {"task": reward},
                      metadata={"task_id": task, "seed": seed})


@pytest.mark.parametrize("path", ["log_turn", "log_step", "record_trajectory", "record_trajectories"])
def test_new_turn_fields_round_trip_on_every_write_path(store: RunStore, path):
    helper, policy = _helper_turn(), make_turn("answer", offset=50)
    policy.logprob_spec = LogprobSpec(temperature=1.0, backend="hf")
    traj = Trajectory(messages=[UserMessage(content="q"), helper.message, policy.message], turns=[helper, policy],
                      rewards={"r": 1.0})
    if path in ("log_turn", "log_step"):
        rid = store.start_run(kind="train")
        if path == "log_turn":
            store.log_messages(rid, traj.messages)
            for t in traj.turns:
                store.log_turn(rid, t)
        else:
            store.log_step(rid, traj.messages, traj.turns)
        store.finish_run(rid, outcome={"rewards": {"r": 1.0}})
    elif path == "record_trajectory":
        rid = store.record_trajectory(traj)
    else:
        [rid] = store.record_trajectories([traj])
    back = store.load_trajectory(rid)
    for got, want in zip(back.turns, traj.turns, strict=True):
        assert got.logprob_spec == want.logprob_spec
        assert (got.trainable, got.purpose, got.unavailable) == (want.trainable, want.purpose, want.unavailable)
        assert (got.prompt_ids, got.completion_ids, got.loss_mask) == (want.prompt_ids, want.completion_ids,
                                                                       want.loss_mask)
        assert got.logprobs == want.logprobs and got.message == want.message
    assert [v.model_dump() for v in back.token_view()] == [v.model_dump() for v in traj.token_view()]
    assert len(back.token_view(include_untrainable=True)) == 2  # the helper turn is still there


def test_a_version_1_file_is_migrated_with_turn_defaults(store_path, monkeypatch):
    with duckdb.connect(str(store_path)) as con:  # a file written before the new columns existed
        monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:1])
        migrate(con)
        monkeypatch.undo()
        con.execute("INSERT INTO runs (id, kind, status, started_at, updated_at) VALUES ('old', 'run', 'completed', "
                    "now()::TIMESTAMP, now()::TIMESTAMP)")
        con.execute("INSERT INTO turns (run_id, idx, message, prompt_ids, completion_ids, created_at) VALUES "
                    "('old', 0, '{\"role\": \"assistant\", \"content\": \"hi\"}', [1, 2], [3], now()::TIMESTAMP)")
    store = RunStore(store_path)
    [turn] = store.load_trajectory("old").turns
    assert (turn.trainable, turn.purpose, turn.unavailable, turn.logprob_spec) == (True, "policy", {}, None)
    assert turn.completion_ids == [3]
    rid = store.start_run()
    store.log_metrics(rid, 0, {"loss": 1.0})  # the new table exists
    with duckdb.connect(str(store_path)) as con:
        assert con.execute("SELECT max(version) FROM schema_version").fetchone()[0] == schema.SCHEMA_VERSION == 5


def test_record_trajectories_is_one_transaction(store: RunStore):
    a, b = _episode("t1", 1.0), _episode("t1", 0.0, seed=1)
    ids = store.record_trajectories([a, b], kind="train", graph="react", tags=["rollout"], config={"lr": 1e-5})
    assert ids == [a.id, b.id]
    rec = store.get_run(a.id)
    assert (rec.status, rec.kind, rec.graph, rec.tags, rec.config) == ("completed", "train", "react", ["rollout"],
                                                                      {"lr": 1e-5})
    assert rec.prompt_tokens == 8 and rec.completion_tokens == 6 and rec.outcome == {"rewards": {"task": 1.0}}
    assert len(rec.messages) == 6 and [t.message.text for t in rec.turns] == ["t1-0-0", "t1-0-1"]
    c = _episode("t2", 0.5)
    with pytest.raises(RunStateError, match=a.id):  # one id is taken: nothing of the batch is written
        store.record_trajectories([c, a])
    assert [r.id for r in store.list_runs(limit=None)].count(c.id) == 0
    with pytest.raises(ValueError, match="repeat"):
        store.record_trajectories([c, c])
    with pytest.raises(ValueError, match="status"):
        store.record_trajectories([c], status="running")


@contextmanager
def _count_connections(store: RunStore, counter: list[int]):
    original = store._file.connect

    @contextmanager
    def counting(*args, **kwargs):
        counter.append(threading.get_ident())  # which thread opened the file
        with original(*args, **kwargs) as con:
            yield con

    store._file.connect = counting
    try:
        yield
    finally:
        del store._file.connect  # the method again


def test_iter_trajectories_filters(store: RunStore):
    parent = store.start_run(kind="eval")
    good = [_episode(f"t{i % 3}", float(i % 2), seed=i) for i in range(6)]
    store.record_trajectories(good[:4], kind="episode", graph="react", parent_id=parent, tags=["a"])
    store.record_trajectories(good[4:], kind="train", graph="clarifier", tags=["b"])
    store.record_trajectory(_episode("t9", None), kind="train", status="failed")
    got = {t.id for t in store.iter_trajectories()}
    assert got == {t.id for t in good} | {parent} | {r.id for r in store.list_runs(status="failed")}
    assert [t.id for t in store.iter_trajectories(kind="episode")] == [t.id for t in good[:4]]  # recorded order
    assert {t.id for t in store.iter_trajectories(graph="clarifier")} == {good[4].id, good[5].id}
    assert {t.id for t in store.iter_trajectories(tag="b")} == {good[4].id, good[5].id}
    assert {t.id for t in store.iter_trajectories(parent_id=parent)} == {t.id for t in good[:4]}
    assert {t.id for t in store.iter_trajectories(min_reward=0.5)} == {t.id for t in good if t.rewards["task"] >= 0.5}
    assert {t.id for t in store.iter_trajectories(status="failed")} == {r.id for r in store.list_runs(status="failed")}
    assert {t.id for t in store.iter_trajectories(metadata={"task_id": "t1", "seed": 4})} == {good[4].id}
    assert len(list(store.iter_trajectories(kind="episode", limit=3))) == 3

    [t] = [t for t in store.iter_trajectories(kind="episode") if t.id == good[1].id]
    assert t.rewards == {"task": 1.0} and t.metadata["run_id"] == good[1].id
    assert (t.metadata["graph"], t.metadata["kind"], t.metadata["parent_id"], t.metadata["task_id"]) == (
        "react", "episode", parent, "t1")
    assert t == store.load_trajectory(good[1].id)  # the two read paths agree exactly
    with pytest.raises(ValueError):
        list(store.iter_trajectories(batch_size=0))


def test_task_id_falls_back_to_config_and_tags(store: RunStore):
    a = Trajectory(messages=[UserMessage(content="x")])
    b = Trajectory(messages=[UserMessage(content="y")])
    store.record_trajectory(a, config={"task_id": "from-config"})
    store.record_trajectory(b, tags=["task:from-tag", "trial:0"])
    got = {t.id: t.metadata.get("task_id") for t in store.iter_trajectories()}
    assert got == {a.id: "from-config", b.id: "from-tag"}


def test_iter_trajectories_reads_500_runs_with_a_bounded_number_of_connections(store: RunStore):
    episodes = [_episode(f"t{i % 7}", float(i % 3), n_turns=1, seed=i) for i in range(500)]
    store.record_trajectories(episodes, kind="train")
    opened: list[int] = []
    with _count_connections(store, opened):
        back = list(store.iter_trajectories(kind="train", batch_size=200))
    assert [t.id for t in back] == [t.id for t in episodes]
    assert len(opened) == 3  # the run query with the first batch of 200, then one per further batch
    assert all(len(t.turns) == 1 and len(t.messages) == 4 for t in back)
    assert back[123].turns[0].prompt_ids == episodes[123].turns[0].prompt_ids
    assert back[123].turns[0].message == episodes[123].turns[0].message


def test_list_runs_and_iter_trajectories_share_one_run_filter(store: RunStore):
    """One filter for both (``list_runs`` lacked ``model_spec``): every filter selects the same runs
    either way, model specs compared as stored (a credential in the spec is redacted on both sides)."""
    a = _episode("t0", 1.0, seed=1)
    b = _episode("t1", 0.0, seed=2)
    store.record_trajectories([a], kind="train", graph="react", tags=["x"], model_spec="openai:m@http://u:k@h/v1")
    store.record_trajectories([b], kind="eval", graph="react", model_spec="hf:tiny")
    filters = [{"model_spec": "openai:m@http://u:k@h/v1"}, {"model_spec": "hf:tiny"}, {"kind": "eval"},
               {"graph": "react", "tag": "x"}, {"status": "completed", "model_spec": "nothing"}]
    for f in filters:
        assert {r.id for r in store.list_runs(**f)} == {t.id for t in store.iter_trajectories(**f)}, f
    assert [r.id for r in store.list_runs(model_spec="hf:tiny")] == [b.id]
    [found] = store.list_runs(model_spec="openai:m@http://u:k@h/v1")  # found by what the caller knows
    assert found.id == a.id and "u:k" not in (found.model_spec or "")  # though stored redacted
