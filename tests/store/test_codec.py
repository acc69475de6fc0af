"""Token ids, logprobs and loss masks as BLOBs: the documented layout, exact round trips, bad
values refused before anything is written, and files with the older LIST columns migrated."""

from __future__ import annotations

import math
import struct

import duckdb
import pytest

from closedloop.messages import AssistantMessage, Trajectory, Turn, UserMessage
from closedloop.store import RunStore, schema
from closedloop.store.codec import decode_floats, decode_ids, decode_mask, encode_floats, encode_ids, encode_mask
from closedloop.store.schema import migrate

from .conftest import make_turn

EDGE_IDS = [0, 1, -1, 2**31 - 1, -(2**31), 151_642]
EDGE_FLOATS = [-0.1, -1e-300, -123.456789012345678, 0.0, -0.0, float("-inf"), 5e-324]


def test_layout_is_little_endian_and_headerless():
    assert encode_ids(EDGE_IDS) == struct.pack(f"<{len(EDGE_IDS)}i", *EDGE_IDS)
    assert encode_floats(EDGE_FLOATS) == struct.pack(f"<{len(EDGE_FLOATS)}d", *EDGE_FLOATS)
    assert encode_mask([0, 1, 1, -3]) == struct.pack("<4b", 0, 1, 1, -3)
    assert encode_ids([]) == b"" and encode_ids(None) is None


@pytest.mark.parametrize("mask", [[0, 1, 1, 0], [], [127, -128, 5], [1, 200 - 256]])
def test_round_trip_is_exact(mask):
    assert decode_ids(encode_ids(EDGE_IDS)) == EDGE_IDS
    back = decode_floats(encode_floats(EDGE_FLOATS + [math.nan]))
    assert back[:-1] == EDGE_FLOATS and math.isnan(back[-1])
    assert [math.copysign(1, v) for v in back[:-1]] == [math.copysign(1, v) for v in EDGE_FLOATS]
    assert decode_mask(encode_mask(mask)) == mask
    assert decode_ids(None) is None and decode_mask(b"") == []


@pytest.mark.parametrize("field, values, match", [("prompt_ids", [1, 2**31], "int32"),
                                                  ("completion_ids", [-(2**31) - 1], "int32"),
                                                  ("loss_mask", [0, 128, 1], "int8")])
def test_out_of_range_values_are_refused_before_writing(store: RunStore, field, values, match):
    ok = make_turn("fine")
    fields = {"prompt_ids": [1, 2], "completion_ids": [3], "loss_mask": [0, 0, 1], field: values}
    if field != "loss_mask":
        fields["loss_mask"] = [0] * len(fields["prompt_ids"]) + [1] * len(fields["completion_ids"])
    bad = Turn(message=AssistantMessage(content="bad"), **fields)
    with pytest.raises(ValueError, match=match):
        store.record_trajectories([Trajectory(turns=[ok]), Trajectory(turns=[bad])])
    assert store.list_runs() == []  # nothing of the batch


def test_turn_arrays_round_trip_through_every_read(store: RunStore):
    t = Turn(message=AssistantMessage(content="x"), prompt_ids=EDGE_IDS, completion_ids=[7, 8],
             logprobs=[-0.1, -1e-300], loss_mask=[0, 1, 0, 1, 0, 0, 1, 1])
    no_tokens = Turn(message=AssistantMessage(content="remote"))
    empty = Turn(message=AssistantMessage(content="empty"), prompt_ids=[], completion_ids=[], logprobs=[])
    [rid] = store.record_trajectories([Trajectory(messages=[UserMessage(content="q"), t.message],
                                                  turns=[t, no_tokens, empty])])
    for back in (store.load_trajectory(rid), next(store.iter_trajectories())):
        got = back.turns
        assert (got[0].prompt_ids, got[0].completion_ids, got[0].logprobs, got[0].loss_mask) == (
            t.prompt_ids, t.completion_ids, t.logprobs, t.loss_mask)
        assert (got[1].prompt_ids, got[1].completion_ids, got[1].logprobs, got[1].loss_mask) == (None,) * 4
        assert (got[2].prompt_ids, got[2].completion_ids, got[2].logprobs, got[2].loss_mask) == ([], [], [], [])
        assert got[0].message is back.messages[1]  # parsed once, shared as when it was recorded


def _v2_file(path, monkeypatch) -> None:
    """A file as closedloop wrote it before version 3: LIST columns."""
    with duckdb.connect(str(path)) as con:
        monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:2])
        migrate(con)
        monkeypatch.undo()
        con.execute("INSERT INTO runs (id, kind, status, started_at, updated_at) VALUES ('old', 'train', 'completed', "
                    "now()::TIMESTAMP, now()::TIMESTAMP)")
        rows = [(0, [1, 2, 2**31 - 1], [3], [-0.1], [0, 0, 1, 1], "tempered"),
                (1, None, None, None, None, None),
                (2, [], [], [], [], None),
                (3, [5, 6], [7, 8], [-1e-300, -2.5], [0, 1, 1, 0], "processed"),
                (4, [9], [10], [-0.7], [0, 1], None)]
        for idx, p, c, lp, mask, mode in rows:
            spec = None if mode is None else f'{{"mode": "{mode}", "temperature": 0.7, "top_p": 1.0, "backend": "hf"}}'
            con.execute("INSERT INTO turns (run_id, idx, message, prompt_ids, completion_ids, logprobs, loss_mask, "
                        "created_at, logprob_spec, trainable, purpose) VALUES ('old', ?, ?, ?, ?, ?, ?, "
                        "now()::TIMESTAMP, ?, ?, ?)",
                        [idx, f'{{"role": "assistant", "content": "t{idx}"}}', p, c, lp, mask, spec, idx != 3,
                         "policy" if idx != 3 else "reask"])
        con.execute("DELETE FROM turns WHERE idx = 4")  # a gap in the row ids
        for idx, text in enumerate(["q", "t0"]):
            role = "user" if idx == 0 else "assistant"
            con.execute("INSERT INTO messages VALUES ('old', ?, ?, ?)",
                        [idx, role, f'{{"role": "{role}", "content": "{text}"}}'])


def test_a_version_2_file_is_migrated_to_blobs(store_path, monkeypatch):
    _v2_file(store_path, monkeypatch)
    monkeypatch.setattr(schema, "_MIGRATION_CHUNK", 2)  # several chunks, in order
    store = RunStore(store_path)
    old = store.load_trajectory("old")
    turns = old.turns
    assert [t.message.text for t in turns] == ["t0", "t1", "t2", "t3"]
    assert [(m.role, m.text) for m in old.messages] == [("user", "q"), ("assistant", "t0")]
    assert (turns[0].prompt_ids, turns[0].completion_ids, turns[0].logprobs, turns[0].loss_mask) == (
        [1, 2, 2**31 - 1], [3], [-0.1], [0, 0, 1, 1])
    assert (turns[1].prompt_ids, turns[1].logprobs, turns[1].loss_mask) == (None, None, None)
    assert (turns[2].prompt_ids, turns[2].completion_ids, turns[2].logprobs, turns[2].loss_mask) == ([], [], [], [])
    assert turns[3].logprobs == [-1e-300, -2.5] and turns[3].loss_mask == [0, 1, 1, 0]
    assert (turns[3].trainable, turns[3].purpose, turns[3].logprob_spec.mode) == (False, "reask", "processed")
    with duckdb.connect(str(store_path)) as con:
        types = dict(con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                 "WHERE table_name = 'turns'").fetchall())
        assert [types[c] for c in ("prompt_ids", "completion_ids", "logprobs", "loss_mask")] == ["BLOB"] * 4
        assert [r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = "
                                          "'turns' ORDER BY ordinal_position").fetchall()] == list(schema.TURN_COLUMNS)
        assert con.execute("SELECT max(version) FROM schema_version").fetchone()[0] == schema.SCHEMA_VERSION == 5
    [rid] = store.record_trajectories([Trajectory(turns=[make_turn()])])  # and the new table takes writes
    assert store.load_trajectory(rid).turns[0].prompt_ids == make_turn().prompt_ids
    assert [t.purpose for t in store.load_trajectory("old").turns] == ["policy"] * 3 + ["reask"]


def test_the_default_mask_is_left_out_and_restored(store_path, tmp_path):
    store = RunStore(store_path)
    default = make_turn("default")  # Turn fills in 0 on the prompt, 1 on the completion
    custom = make_turn("custom").model_copy(update={"loss_mask": [0, 0, 0, 0, 1, 0, 1]})
    [rid] = store.record_trajectories([Trajectory(turns=[default, custom])])
    with duckdb.connect(str(store_path)) as con:
        masks = [r[0] for r in con.execute("SELECT loss_mask FROM turns ORDER BY idx").fetchall()]
    assert masks == [None, bytes([0, 0, 0, 0, 1, 0, 1])]
    assert [t.loss_mask for t in store.load_trajectory(rid).turns] == [default.loss_mask, custom.loss_mask]
    paths = store.export_parquet(tmp_path / "pq")
    with duckdb.connect() as con:
        rows = con.execute(f"SELECT loss_mask, logprobs FROM '{paths['turns']}' ORDER BY idx").fetchall()
    assert [list(r[0]) for r in rows] == [default.loss_mask, custom.loss_mask]
    assert [r[1] for r in rows] == [default.logprobs, custom.logprobs]
