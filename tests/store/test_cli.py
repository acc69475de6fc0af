"""``closedloop runs ...`` through the real argument parser, and once as a real subprocess."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import timedelta

import duckdb
import pytest

from closedloop.cli import main
from closedloop.cli.runs import parse_duration
from closedloop.messages import UserMessage
from closedloop.store import RunStore
from closedloop.tool import ToolResult

from .conftest import KILLED_WRITER_IMPORT, REPO, make_turn, run_python


@pytest.fixture
def filled(store_path):
    store = RunStore(store_path)
    with store.run(kind="eval", graph="react", model_spec="openai:gpt-4o-mini") as run:
        run.log_messages([UserMessage(content="what is 2+3?")])
        t = make_turn("adding", tool="add", args={"a": 2, "b": 3}, n_prompt=11, n_completion=7)
        run.log_turn(t)
        run.log_messages([t.message])
        run.log_tool_call(t.message.tool_calls[0], ToolResult("add", "", error="add raised ValueError: nope [bold]",
                                                             error_kind="exception", latency_s=0.125))
        run.outcome.update(answer="5", rewards={"exact": 1.0})
    failed = store.start_run(kind="train", graph="plan")
    store.finish_run(failed, "failed", error="boom")
    return store, run.id, failed


def test_list_table_and_filters(filled, capsys):
    store, ok, failed = filled
    assert main(["runs", "list", "--store", str(store.path)]) == 0
    out = capsys.readouterr().out
    assert ok[:12] in out and failed[:12] in out and "completed" in out and "11/7" in out
    assert main(["runs", "list", "--store", str(store.path), "--status", "failed"]) == 0
    out = capsys.readouterr().out
    assert failed[:12] in out and ok[:12] not in out
    assert main(["runs", "list", "--store", str(store.path), "--limit", "1", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["id"] == failed and row["status"] == "failed"


def test_show_prints_messages_turns_tool_calls_and_outcome(filled, capsys):
    store, ok, _ = filled
    assert main(["runs", "show", ok[:8], "--store", str(store.path)]) == 0
    out = capsys.readouterr().out
    assert ok in out and "what is 2+3?" in out and 'add({"a": 2, "b": 3})' in out
    assert "0.125s" in out and "add raised ValueError: nope [bold]" in out and "exception" in out
    assert '"exact": 1.0' in out and "11" in out and "7" in out
    assert main(["runs", "show", ok, "--store", str(store.path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["turns"][0]["usage"]["prompt_tokens"] == 11
    assert main(["runs", "show", "doesnotexist", "--store", str(store.path)]) == 1
    assert "no run" in capsys.readouterr().err


def test_export_and_prune(filled, tmp_path, capsys):
    store, ok, failed = filled
    assert main(["runs", "export", "--store", str(store.path), "--parquet", str(tmp_path / "pq")]) == 0
    assert "turns.parquet" in capsys.readouterr().out
    assert duckdb.connect().execute(f"SELECT count(*) FROM '{tmp_path / 'pq' / 'runs.parquet'}'").fetchone()[0] == 2

    assert main(["runs", "prune", "--store", str(store.path), "--older-than", "30d"]) == 0
    assert "deleted 0 run(s)" in capsys.readouterr().out
    assert main(["runs", "prune", "--store", str(store.path), "--older-than", "0s"]) == 0
    assert "deleted 2 run(s)" in capsys.readouterr().out
    assert store.list_runs() == []


@pytest.mark.parametrize("text,expected", [("30d", timedelta(days=30)), ("12h", timedelta(hours=12)),
                                           ("90m", timedelta(minutes=90)), ("45s", timedelta(seconds=45)),
                                           ("1.5d", timedelta(hours=36))])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("bad", ["30", "d", "-1d", "3w", ""])
def test_bad_duration_is_a_usage_error(bad, store_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["runs", "prune", "--store", str(store_path), f"--older-than={bad}"])
    assert e.value.code == 2 and "invalid duration" in capsys.readouterr().err


def test_python_m_closedloop_runs_list_sees_a_killed_run(store_path):
    killed = run_python(KILLED_WRITER_IMPORT, str(store_path))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_id = killed.stdout.strip()
    proc = subprocess.run([sys.executable, "-m", "closedloop", "runs", "list", "--store", str(store_path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert run_id[:12] in proc.stdout and "killed" in proc.stdout
