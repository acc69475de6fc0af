"""The main job, as a user runs it: the tiny model served by ``closedloop serve``, the react graph
run against it by ``closedloop run`` through the ``openai:`` backend, the run read back from the
store. Everything is real: subprocesses, HTTP, DuckDB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from closedloop.cli import main
from closedloop.models.chat_format import parse_completion
from closedloop.server.local import serve_subprocess
from closedloop.store import RunStore

pytestmark = pytest.mark.slow
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def server(tiny_model_path):
    with serve_subprocess(f"hf:{tiny_model_path}", "--torch-threads", "1", env=ENV) as url:
        yield url


def _run_cli(args: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "closedloop", *args], input=stdin, text=True,
                          capture_output=True, env=ENV, timeout=300)


def test_run_react_against_the_server_records_a_token_exact_run(server, tiny_model_path, tmp_path):
    db = tmp_path / "runs.duckdb"
    out = _run_cli(["run", "react", "--model", f"openai:tiny@{server}", "--tools", "arithmetic",
                    "--input", "What is 3 plus 4?", "--store", str(db), "--max-turns", "3"])
    assert out.returncode == 0, out.stderr + out.stdout
    store = RunStore(db)
    [summary] = store.list_runs()
    run = store.get_run(summary.id)
    assert run.status == "completed" and run.graph == "react"
    assert run.model_spec == f"openai:tiny@{server}"
    assert run.messages[0].role == "user" and run.messages[0].text == "What is 3 plus 4?"
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    assert run.turns, "no model turn was recorded"
    for turn in run.turns:  # token-exact through HTTP: the ids decode to the message the graph saw
        assert turn.completion_ids and turn.prompt_ids
        assert len(turn.logprobs) == len(turn.completion_ids)
        decoded = parse_completion(tok.decode(turn.completion_ids))
        assert decoded.text == turn.message.text
        assert [(c.name, json.loads(c.function.arguments)) for c in decoded.tool_calls or []] == \
            [(c.name, json.loads(c.function.arguments)) for c in turn.message.tool_calls or []]
    # turn 2's prompt extends turn 1's prompt + completion (tool result appended), token for token
    if len(run.turns) > 1:
        first, second = run.turns[0], run.turns[1]
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == \
            first.prompt_ids + first.completion_ids
    # the warmed-up tiny model calls the tool; the call and its result are in the store
    names = [c.name for c in run.tool_calls]
    assert "add" in names
    shown = _run_cli(["runs", "show", summary.id, "--store", str(db)])
    assert shown.returncode == 0 and "add" in shown.stdout


def test_interactive_session_with_approval(tiny_model_path, tmp_path):
    """The REPL over the hf: backend: a question, an approval prompt answered yes, then quit."""
    db = tmp_path / "runs.duckdb"
    out = _run_cli(["run", "react", "--model", f"hf:{tiny_model_path}", "--approve", "--store", str(db),
                    "--max-turns", "3"], stdin="What is 2 plus 5?\ny\ny\ny\n\n")
    assert out.returncode == 0, out.stderr + out.stdout
    run = RunStore(db).get_run(RunStore(db).list_runs()[0].id)
    assert run.status == "completed"
    assert [m.role for m in run.messages][:2] == ["user", "assistant"]


def test_killed_cli_run_is_marked_killed(tiny_model_path, tmp_path):
    db = tmp_path / "runs.duckdb"
    proc = subprocess.Popen([sys.executable, "-m", "closedloop", "run", "react", "--model", f"hf:{tiny_model_path}",
                             "--store", str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)
    deadline = time.monotonic() + 600  # only ends a hung test: the wait is for the run, however slow the start
    while proc.poll() is None:  # until the run is in the store, then kill the process
        assert time.monotonic() < deadline, "the run never reached the store"
        if db.exists():
            try:
                if RunStore(db, lock_timeout_s=1).list_runs():
                    break
            except Exception:
                pass
        time.sleep(0.3)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.kill()
    proc.wait()
    [summary] = RunStore(db).list_runs()
    assert summary.status == "killed"


def test_graphs_and_tools_are_listed(capsys):
    assert main(["graphs"]) == 0
    text = capsys.readouterr().out
    assert "react" in text and "clarifier" in text
    assert main(["tools"]) == 0
    text = capsys.readouterr().out
    for name in ["add", "cartesian_decompose", "compatibility_certificate", "conditional_krr_fit",
                 "pc_bp_alignment", "spike_attention_density_bias"]:
        assert name in text


def test_tools_are_callable_by_json_through_the_registry():
    import asyncio

    from closedloop.plugins import tool_registry

    registry = tool_registry()
    result = asyncio.run(registry.call_json("cartesian_3j_tensor", json.dumps({"l_a": 1, "l_b": 1, "l_c": 0})))
    assert result.ok, result.content
    bad = asyncio.run(registry.call_json("cartesian_3j_tensor", '{"l_a": 1, "l_b": 1, "l_c": 5}'))
    assert not bad.ok
