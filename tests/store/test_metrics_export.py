"""Per-step metrics, and training rows (SFT, preference pairs, GRPO groups) from the API and the CLI."""

from __future__ import annotations

import json
import math

import pytest

from closedloop.cli import main
from closedloop.messages import AssistantMessage, SystemMessage, Trajectory, UserMessage
from closedloop.store import RunStateError, RunStore
from closedloop.store.export import grpo_groups, preference_pairs, sft_rows, task_key

from .test_trajectories import _episode


def test_log_metrics_single_and_many_steps(store: RunStore):
    rid = store.start_run(kind="train")
    assert store.log_metrics(rid, 0, {"loss": 2.5, "reward/correct": 0.25, "kl": 0}) == 3
    assert store.log_metrics(rid, [(1, {"loss": 2.0}), (2, {"loss": 1.5, "clip_frac": 0.1})]) == 3
    store.log_metrics(rid, 1, {"loss": 1.9})  # a re-logged value: the later one is shown
    assert store.log_metrics(rid, 3, {"entropy": float("nan")}, wait=False) == 1
    store.finish_run(rid)
    rows = store.metrics(rid)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0] == {"step": 0, "loss": 2.5, "reward/correct": 0.25, "kl": 0.0}
    assert rows[1] == {"step": 1, "loss": 1.9} and rows[2] == {"step": 2, "loss": 1.5, "clip_frac": 0.1}
    assert math.isnan(rows[3]["entropy"])
    assert store.metrics(store.start_run()) == []
    with pytest.raises(RunStateError):
        store.log_metrics(rid, 4, {"loss": 1.0})  # the run is finished


@pytest.mark.parametrize("bad", [(-1, {"a": 1.0}), (True, {"a": 1.0}), (0, {"": 1.0}), (0, {"a": "high"}),
                                 (0, {"a": None}), (0, [1.0]), ("x",)])
def test_bad_metrics_are_clear_errors_and_write_nothing(store: RunStore, bad):
    rid = store.start_run()
    with pytest.raises((TypeError, ValueError)):
        store.log_metrics(rid, [(0, {"ok": 1.0}), bad])
    assert store.metrics(rid) == []


def test_runs_show_prints_a_metrics_summary(store_path, capsys):
    store = RunStore(store_path)
    rid = store.start_run(kind="train")
    store.log_metrics(rid, [(s, {"loss": 3.0 - s, "kl": 0.01 * s}) for s in range(5)])
    assert main(["runs", "show", rid, "--store", str(store_path)]) == 0
    out = capsys.readouterr().out
    assert "metrics (5 steps, 0..4)" in out and "loss" in out and "kl" in out
    cells = [c.strip() for c in next(l for l in out.splitlines() if "loss" in l).split("│") if c.strip()]
    assert cells == ["loss", "5", "3", "-1", "-1", "3"]  # metric, steps, first, last, min, max
    other = store.start_run()
    assert main(["runs", "show", other, "--store", str(store_path)]) == 0
    assert "metrics (" not in capsys.readouterr().out


def _corpus() -> list[Trajectory]:
    return [_episode("t1", 1.0, seed=0), _episode("t1", 0.0, seed=1), _episode("t1", 1.0, seed=2),
            _episode("t2", 0.5, seed=3), _episode("t2", 0.5, seed=4),  # same reward: no pair
            _episode("t3", 0.0, seed=5),  # alone: a group, no pair
            _episode("t4", None, seed=6)]  # unrewarded: SFT only


def test_sft_rows_are_openai_conversations():
    trajs = _corpus()
    trajs[0].metadata["tools"] = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    rows = list(sft_rows(trajs))
    assert len(rows) == len(trajs)
    assert rows[0]["messages"] == [m.to_openai() for m in trajs[0].messages]
    assert rows[0]["messages"][2]["tool_calls"][0]["function"]["name"] == "add"
    assert rows[0]["tools"][0]["function"]["name"] == "add" and "tools" not in rows[1]
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0, 0.5, 0.5, 0.0, None]
    assert rows[3]["run_id"] == trajs[3].id
    no_answer = Trajectory(messages=[UserMessage(content="hi")])
    assert list(sft_rows([no_answer])) == []


def test_pairs_only_within_a_task_and_with_different_rewards():
    trajs = _corpus()
    pairs = list(preference_pairs(trajs))
    assert {(p["chosen_id"], p["rejected_id"]) for p in pairs} == {(trajs[0].id, trajs[1].id),
                                                                     (trajs[2].id, trajs[1].id)}
    p = pairs[0]
    assert p["task_id"] == "t1" and (p["chosen_reward"], p["rejected_reward"]) == (1.0, 0.0)
    assert p["prompt"] == [m.to_openai() for m in trajs[0].messages[:2]]
    assert p["chosen"] == [m.to_openai() for m in trajs[0].messages[2:]]
    assert p["rejected"] == [m.to_openai() for m in trajs[1].messages[2:]]
    assert p["chosen"][0]["role"] == "assistant" and p["chosen"] != p["rejected"]
    [bw] = list(preference_pairs(trajs, strategy="best_worst"))
    assert (bw["chosen_id"], bw["rejected_id"]) == (trajs[0].id, trajs[1].id)
    assert list(preference_pairs(trajs, min_margin=1.0)) == []


def test_pairs_need_the_same_prompt_unless_told_otherwise():
    a, b = _episode("t1", 1.0), _episode("t1", 0.0, seed=1)
    b.messages[1] = UserMessage(content="a differently worded request")
    assert list(preference_pairs([a, b])) == []
    [p] = list(preference_pairs([a, b], require_same_prompt=False))
    assert p["prompt"][1]["content"] == "task t1"


def test_task_key_falls_back_to_the_prompt():
    prompt = [SystemMessage(content="s"), UserMessage(content="2+2?")]
    a = Trajectory(messages=[*prompt, AssistantMessage(content="4")], rewards={"r": 1.0})
    b = Trajectory(messages=[*prompt, AssistantMessage(content="5")], rewards={"r": 0.0})
    c = Trajectory(messages=[SystemMessage(content="s"), UserMessage(content="3+3?"), AssistantMessage(content="6")],
                   rewards={"r": 1.0})
    assert task_key(a) == task_key(b) != task_key(c) and task_key(a).startswith("prompt:")
    assert [g["trajectories"] for g in grpo_groups([a, b, c])] == [[a.id, b.id], [c.id]]


def test_groups_one_per_task_with_rewards_in_order():
    trajs = _corpus()
    groups = list(grpo_groups(trajs))
    assert [g["task_id"] for g in groups] == ["t1", "t2", "t3"]
    assert groups[0] == {"task_id": "t1", "trajectories": [t.id for t in trajs[:3]], "rewards": [1.0, 0.0, 1.0]}
    assert [g["task_id"] for g in grpo_groups(trajs, min_size=2)] == ["t1", "t2"]


def test_cli_export_formats_from_the_store(store_path, tmp_path, capsys):
    store = RunStore(store_path)
    trajs = _corpus()
    store.record_trajectories(trajs[:5], kind="train", graph="react", tags=["rollouts"])
    store.record_trajectories(trajs[5:], kind="episode", graph="react")
    store.record_trajectory(_episode("t1", 1.0, seed=9), kind="train", status="failed")

    def export(*extra: str) -> list[dict]:
        out = tmp_path / "out.jsonl"
        assert main(["runs", "export", "--store", str(store_path), "--out", str(out), *extra]) == 0
        capsys.readouterr()
        return [json.loads(line) for line in out.read_text().splitlines()]

    sft = export("--format", "sft")
    assert [r["run_id"] for r in sft] == [t.id for t in trajs]  # the failed run is left out by default
    assert sft[0]["messages"][1] == {"role": "user", "content": "task t1"}
    assert [r["run_id"] for r in export("--format", "sft", "--kind", "episode")] == [t.id for t in trajs[5:]]
    assert [r["run_id"] for r in export("--format", "sft", "--min-reward", "0.5")] == [
        t.id for t in trajs if t.rewards and sum(t.rewards.values()) >= 0.5]
    assert len(export("--format", "sft", "--status", "any")) == len(trajs) + 1
    pairs = export("--format", "pairs", "--tag", "rollouts")
    assert {(p["chosen_id"], p["rejected_id"]) for p in pairs} == {(trajs[0].id, trajs[1].id),
                                                                     (trajs[2].id, trajs[1].id)}
    groups = export("--format", "groups", "--graph", "react")
    assert [(g["task_id"], len(g["trajectories"])) for g in groups] == [("t1", 3), ("t2", 2), ("t3", 1)]

    assert main(["runs", "export", "--store", str(store_path), "--format", "sft"]) == 2  # no --out
    assert "--out" in capsys.readouterr().err
    assert main(["runs", "export", "--store", str(store_path), "--parquet", str(tmp_path / "pq")]) == 0
    assert "metrics:" in capsys.readouterr().out


RESUMED_TRAINER = """
import sys
from closedloop.store import RunStore
store = RunStore(sys.argv[1])
run_id, first, last, scale = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
store.reopen_run(run_id)
for step in range(first, last):  # a resumed trainer replays the steps after its last checkpoint
    store.log_metrics(run_id, step, {"loss": scale * step, "kl": 0.1}, wait=step % 2 == 0)
store.finish_run(run_id)
"""


def test_a_resumed_run_replaying_steps_leaves_one_row_per_step_and_name(store_path, tmp_path):
    import duckdb
    import pyarrow.parquet as pq

    from .conftest import run_python

    store = RunStore(store_path)
    rid = store.start_run(kind="train")
    store.log_metrics(rid, [(s, {"loss": float(s), "kl": 0.1}) for s in range(6)])
    store.finish_run(rid, status="killed")
    for first, last, scale in ((4, 9, 10.0), (7, 12, 100.0)):  # two resumes, each replaying two steps
        proc = run_python(RESUMED_TRAINER, str(store_path), rid, str(first), str(last), str(scale))
        assert proc.returncode == 0, proc.stderr
    with duckdb.connect(str(store_path), read_only=True) as con:
        assert con.execute("SELECT count(*), count(DISTINCT (step, name)) FROM metrics").fetchone() == (24, 24)
    rows = store.metrics(rid)
    assert [r["step"] for r in rows] == list(range(12))
    assert [r["loss"] for r in rows] == [0, 1, 2, 3, 40, 50, 60, 700, 800, 900, 1000, 1100]  # the latest wins
    table = pq.read_table(store.export_parquet(tmp_path / "pq")["metrics"]).to_pylist()
    assert len(table) == 24 and len({(r["step"], r["name"]) for r in table}) == 24


def test_an_older_file_with_duplicate_metrics_keeps_the_latest_on_upgrade(store_path):
    import duckdb

    from closedloop.store import schema

    with duckdb.connect(str(store_path)) as con:
        original = schema.MIGRATIONS
        schema.MIGRATIONS = original[:4]  # a file written before metrics had a key
        try:
            schema.migrate(con)
        finally:
            schema.MIGRATIONS = original
        con.execute("INSERT INTO runs (id, kind, status, started_at, updated_at) VALUES ('r', 'train', 'completed', "
                    "now()::TIMESTAMP, now()::TIMESTAMP)")
        con.executemany("INSERT INTO metrics VALUES ('r', ?, 'loss', ?, ?::TIMESTAMP)",
                        [(1, 1.0, "2024-01-01"), (1, 2.0, "2024-01-02"), (2, 3.0, "2024-01-01"), (1, 0.5, "2023-12-31")])
    store = RunStore(store_path)
    assert store.metrics("r") == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 3.0}]
    with duckdb.connect(str(store_path), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM metrics").fetchone() == (2,)
