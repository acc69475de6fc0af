"""Images and audio are stored once, as artifacts, and every reader rebuilds the parts exactly."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from datetime import timedelta

import duckdb
import pytest

from closedloop.cli import main
from closedloop.messages import (AssistantMessage, AudioPart, ImagePart, SystemMessage, TextPart, Trajectory,
                                 Turn, Usage, UserMessage)
from closedloop.models.multimodal import media_refs
from closedloop.store import RunStore, schema
from closedloop.store.media import REF_PREFIX

# Bytes whose base64 is long enough for the redactor's "long base64 run" rule and holds key-like words.
IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8
OTHER_IMAGE = b"GIF89a" + bytes(reversed(range(256))) * 5
AUDIO = b"RIFF" + bytes((i * 7) % 256 for i in range(3000))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def multimodal_trajectory(text: str = "what is in the picture and the clip?", image: bytes = IMAGE) -> Trajectory:
    user = UserMessage(content=[TextPart(text=text), ImagePart.from_bytes(image, "image/png"),
                                AudioPart.from_bytes(AUDIO, "wav"),
                                ImagePart.from_url(f"data:image/gif;base64,{b64(OTHER_IMAGE)}", detail="low")])
    prompt = [SystemMessage(content="Describe media."), user]
    answer = AssistantMessage(content="a cat meowing")
    turn = Turn(message=answer, model="tiny-vlm", prompt_ids=[1, 2, 3], completion_ids=[4, 5], logprobs=[-0.1, -0.2],
                usage=Usage(prompt_tokens=3, completion_tokens=2), media=media_refs(prompt))
    return Trajectory(messages=[*prompt, answer], turns=[turn], rewards={"ok": 1.0})


def stored_json(path) -> list[str]:
    with duckdb.connect(str(path)) as con:
        return ([r[0] for r in con.execute("SELECT json FROM messages").fetchall()]
                + [r[0] for r in con.execute("SELECT message FROM turns").fetchall()])


def dump(traj: Trajectory) -> tuple:
    return ([m.model_dump() for m in traj.messages], [t.model_dump() for t in traj.turns])


def test_round_trip_is_exact_through_every_reader_and_writer(store_path):
    store = RunStore(store_path)
    traj = multimodal_trajectory()
    assert [r.kind for r in traj.turns[0].media] == ["image", "audio", "image"]
    [bulk] = store.record_trajectories([traj])
    with store.run(kind="run") as run:  # synchronous writes
        run.log_messages(traj.messages[:2])
        run.log_turn(traj.turns[0])
        run.log_messages(traj.messages[2:])
    with store.run(kind="run") as queued:  # the background writer
        queued.log_step(traj.messages[:2], [traj.turns[0]])
        queued.log_step(traj.messages[2:])
    want = dump(traj)
    for rid in (bulk, run.id, queued.id):
        assert dump(store.load_trajectory(rid)) == want
        record = store.get_run(rid)
        assert [m.model_dump() for m in record.messages] == want[0]
    by_id = {t.id: t for t in store.iter_trajectories(batch_size=2)}
    assert all(dump(by_id[rid]) == want for rid in (bulk, run.id, queued.id))
    assert by_id[bulk].turns[0].media == traj.turns[0].media
    # the rebuilt prompt addresses the same bytes the turn recorded
    assert media_refs(by_id[bulk].messages[:2]) == traj.turns[0].media


def test_rows_hold_references_not_base64_and_bytes_are_stored_once(store_path):
    store = RunStore(store_path)
    first, second = store.record_trajectories([multimodal_trajectory(), multimodal_trajectory("again")])
    with store.run() as run:  # a third run, another transaction, same picture
        run.log_messages([UserMessage(content=[ImagePart.from_bytes(IMAGE)])])
    rows = stored_json(store_path)
    for payload in (b64(IMAGE), b64(AUDIO), b64(OTHER_IMAGE)):
        assert not any(payload[:200] in r for r in rows)
    assert not any("base64," in r for r in rows)
    digest = hashlib.sha256(IMAGE).hexdigest()
    assert any(f"{REF_PREFIX}{digest};mime=image/png" in r for r in rows)
    with duckdb.connect(str(store_path)) as con:
        media = con.execute("SELECT sha256, mime, size, data FROM media ORDER BY size").fetchall()
        users = con.execute("SELECT run_id FROM run_media WHERE sha256 = ? ORDER BY run_id", [digest]).fetchall()
    assert sorted((m[1], m[2]) for m in media) == sorted([("image/png", len(IMAGE)), ("audio/wav", len(AUDIO)),
                                                          ("image/gif", len(OTHER_IMAGE))])
    assert {m[0]: m[3] for m in media}[digest] == IMAGE
    assert [u[0] for u in users] == sorted([first, second, run.id])
    assert store.media_bytes(f"sha256:{digest}") == IMAGE


def test_references_without_bytes_on_request(store_path):
    store = RunStore(store_path)
    [rid] = store.record_trajectories([multimodal_trajectory()])
    refs = store.load_trajectory(rid, media="refs")
    image = refs.messages[1].content[1]
    assert image.image_url.url == f"{REF_PREFIX}{hashlib.sha256(IMAGE).hexdigest()};mime=image/png"
    assert refs.messages[1].content[2].input_audio.data == REF_PREFIX + hashlib.sha256(AUDIO).hexdigest()
    assert refs.messages[1].content[3].image_url.detail == "low"
    [listed] = store.iter_trajectories(media="refs")
    assert dump(listed) == dump(refs)
    with pytest.raises(ValueError, match="inline"):
        store.get_run(rid, media="base64")


def test_exports_rebuild_the_parts(store_path, tmp_path, capsys):
    store = RunStore(store_path)
    traj = multimodal_trajectory()
    store.record_trajectories([traj], kind="eval")
    out = tmp_path / "sft.jsonl"
    assert main(["runs", "export", "--store", str(store_path), "--format", "sft", "--out", str(out)]) == 0
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["messages"] == [m.to_openai() for m in traj.messages]

    paths = store.export_parquet(tmp_path / "pq")
    with duckdb.connect() as con:
        msgs = [r[0] for r in con.execute(f"SELECT json FROM '{paths['messages']}' ORDER BY idx").fetchall()]
        [turn_msg] = con.execute(f"SELECT message FROM '{paths['turns']}'").fetchone()
    assert [json.loads(m) for m in msgs] == [m.model_dump(mode="json", exclude_none=True) for m in traj.messages]
    assert json.loads(turn_msg) == traj.turns[0].message.model_dump(mode="json", exclude_none=True)
    assert "media" not in paths

    refs = store.export_parquet(tmp_path / "pq_refs", media="refs")
    with duckdb.connect() as con:
        assert con.execute(f"SELECT count(*) FROM '{refs['messages']}' WHERE contains(json, 'base64,')").fetchone() \
            == (0,)
        blobs = dict(con.execute(f"SELECT sha256, data FROM '{refs['media']}'").fetchall())
    assert blobs[hashlib.sha256(AUDIO).hexdigest()] == AUDIO and len(blobs) == 3


def test_a_version_3_file_with_inline_media_is_migrated(store_path, monkeypatch):
    traj = multimodal_trajectory()
    inline = [m.model_dump_json(exclude_none=True) for m in traj.messages]
    turn_with_image = AssistantMessage(content=[TextPart(text="see"), ImagePart.from_bytes(IMAGE)])
    with duckdb.connect(str(store_path)) as con:
        monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:3])
        schema.migrate(con)
        monkeypatch.undo()
        for rid in ("a", "b"):
            con.execute("INSERT INTO runs (id, kind, status, started_at, updated_at) VALUES (?, 'eval', 'completed', "
                        "now()::TIMESTAMP, now()::TIMESTAMP)", [rid])
            for idx, (m, js) in enumerate(zip(traj.messages, inline)):
                con.execute("INSERT INTO messages VALUES (?, ?, ?, ?)", [rid, idx, m.role, js])
            con.execute("INSERT INTO turns (run_id, idx, message, created_at) VALUES (?, 0, ?, now()::TIMESTAMP)",
                        [rid, turn_with_image.model_dump_json(exclude_none=True)])
        con.execute("INSERT INTO messages VALUES ('b', 9, 'user', ?)",
                    ['{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}'])
    store = RunStore(store_path)
    old = store.load_trajectory("a")
    assert [m.model_dump() for m in old.messages] == [m.model_dump() for m in traj.messages]
    assert old.turns[0].message == turn_with_image and old.turns[0].media == []
    assert store.load_trajectory("b").messages[-1].content[0].image_url.url == "https://x/y.png"  # stays as is
    rows = stored_json(store_path)
    assert not any("base64," in r or b64(AUDIO)[:100] in r for r in rows)
    with duckdb.connect(str(store_path)) as con:
        assert con.execute("SELECT count(*) FROM media").fetchone() == (3,)
        assert con.execute("SELECT count(*) FROM run_media").fetchone() == (6,)
        assert con.execute("SELECT max(version) FROM schema_version").fetchone()[0] == schema.SCHEMA_VERSION == 5


def test_deleting_runs_collects_media_nobody_references(store_path):
    store = RunStore(store_path)
    [gone] = store.record_trajectories([multimodal_trajectory()])  # IMAGE, AUDIO, OTHER_IMAGE
    kept_traj = Trajectory(messages=[UserMessage(content=[ImagePart.from_bytes(IMAGE), TextPart(text="only this")])])
    [kept] = store.record_trajectories([kept_traj])
    with duckdb.connect(str(store_path)) as con:  # the kept run ended in the future, so an age of 0 spares it
        con.execute("UPDATE runs SET ended_at = now()::TIMESTAMP + INTERVAL 1 DAY WHERE id = ?", [kept])
    assert store.delete_older_than(timedelta(0)) == 1
    with duckdb.connect(str(store_path)) as con:
        left = [r[0] for r in con.execute("SELECT sha256 FROM media").fetchall()]
        assert con.execute("SELECT DISTINCT run_id FROM run_media").fetchall() == [(kept,)]
    assert left == [hashlib.sha256(IMAGE).hexdigest()]
    assert dump(store.load_trajectory(kept)) == dump(kept_traj)
    with pytest.raises(KeyError):
        store.media_bytes(hashlib.sha256(AUDIO).hexdigest())
    assert gone not in {r.id for r in store.list_runs()}


def test_secrets_next_to_media_are_redacted_and_media_kept(store_path, monkeypatch):
    secret = "sk-proj-" + "A1b2C3d4" * 5
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-zzzz-private-value")
    traj = multimodal_trajectory(f"my key is {secret} and token tok-zzzz-private-value")
    store = RunStore(store_path)
    [bulk] = store.record_trajectories([traj])
    with store.run() as run:
        run.log_messages(traj.messages)
    rows = stored_json(store_path)
    assert not any(secret in r or "tok-zzzz-private-value" in r for r in rows)
    for rid in (bulk, run.id):
        back = store.load_trajectory(rid).messages[1]
        assert secret not in back.text and "tok-zzzz" not in back.text and "my key is" in back.text
        assert [p.model_dump() for p in back.content[1:]] == [p.model_dump() for p in traj.messages[1].content[1:]]


def test_what_cannot_be_rebuilt_byte_exactly_stays_inline(store):
    odd = "data:image/png;base64," + b64(IMAGE)[:-4] + "\n" + b64(IMAGE)[-4:]  # a line break: not canonical
    quoted = f"see {REF_PREFIX}{'0' * 64};mime=image/png"  # text that only looks like a reference
    traj = Trajectory(messages=[UserMessage(content=[TextPart(text=quoted), ImagePart.from_url(odd),
                                                     ImagePart.from_url("https://example.com/cat.png")])])
    [rid] = store.record_trajectories([traj])
    assert dump(store.load_trajectory(rid)) == dump(traj)


def test_threads_storing_the_same_picture_at_once_all_succeed(store_path):
    """Several stores of one process write the same hash concurrently (a declared primary key
    would fail all but one transaction at commit); every run reads back whole."""
    RunStore(store_path)
    errors: list[BaseException] = []

    def work() -> None:
        store = RunStore(store_path)
        try:
            for i in range(6):
                picture = bytes([i % 3]) * 3000
                store.record_trajectories([Trajectory(messages=[UserMessage(content=[ImagePart.from_bytes(picture)])])])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    back = list(RunStore(store_path).iter_trajectories())
    assert len(back) == 18
    assert {base64.b64decode(t.messages[0].content[0].image_url.url.split(",", 1)[1]) for t in back} == {
        bytes([i]) * 3000 for i in range(3)}
