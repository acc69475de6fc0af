"""``closedloop tool call|schema`` and ``closedloop tools --json`` through the real parser and a real
DuckDB run store; the call must behave exactly as a graph's tool node does."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from closedloop import plugins
from closedloop.cli import main
from closedloop.messages import AssistantMessage, ToolCall
from closedloop.runtime.nodes import run_tool_calls
from closedloop.store import RunStore

REPO = Path(__file__).resolve().parents[2]
# Only the modules these tests use: loading every tool module would import torch for nothing and
# tie these tests to every other module's health.
MODULES = "arithmetic,mesh_certificate"


@pytest.fixture
def store_path(tmp_path) -> Path:
    return tmp_path / "runs.duckdb"


def call(capsys, store_path: Path, *argv: str) -> tuple[int, dict]:
    rc = main(["tool", "call", *argv, "--json", "--tools", MODULES, "--store", str(store_path)])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def recorded(store_path: Path, run_id: str):
    run = RunStore(store_path).get_run(run_id)
    assert run.kind == "tool" and len(run.tool_calls) == 1
    return run, run.tool_calls[0]


def test_a_call_prints_the_result_and_is_recorded_as_a_tool_run(capsys, store_path):
    rc, out = call(capsys, store_path, "add", "--args", '{"a": 2, "b": 3.5}')
    assert rc == 0 and out["ok"] and out["result"] == 5.5
    run, rec = recorded(store_path, out["run_id"])
    assert run.status == "completed" and run.metadata["tool"] == "add"
    assert (rec.name, json.loads(rec.arguments), rec.result, rec.error) == ("add", {"a": 2, "b": 3.5}, "5.5", None)


def test_args_from_a_file(capsys, store_path, tmp_path):
    (tmp_path / "args.json").write_text('{"a": 6, "b": 7}')
    rc, out = call(capsys, store_path, "multiply", "--args", f"@{tmp_path / 'args.json'}")
    assert rc == 0 and out["result"] == 42


def test_the_cli_result_is_what_a_graphs_tool_node_returns(capsys, store_path, tmp_path):
    np.save(tmp_path / "faces.npy", np.array([[0, 1, 2], [1, 3, 2]]))
    arguments = json.dumps({"faces": str(tmp_path / "faces.npy")})
    rc, out = call(capsys, store_path, "mesh_incidence", "--args", arguments)
    assert rc == 0
    state = {"messages": [AssistantMessage(content="", tool_calls=[ToolCall.make("mesh_incidence", arguments)])]}
    update = asyncio.run(run_tool_calls(state, plugins.tool_registry(MODULES.split(","))))
    from_graph = json.loads(update["messages"][0].text)
    from_cli = json.loads(out["content"])
    for report in (from_graph, from_cli):  # each call saves its own artifacts
        for k in ("d0", "d1"):
            report[k].pop("path")
    assert from_cli == from_graph


@pytest.mark.parametrize("argv, kind, needle", [
    (["add", "--args", '{"a": 1}'], "invalid_arguments", "b: Field required"),
    (["add", "--args", '{"a": 1, "b": 2'], "malformed_json", "not valid JSON"),
    (["add", "--args", "[1, 2]"], "invalid_arguments", "must be a JSON object"),
    (["no_such_tool"], "unknown_tool", "unknown tool 'no_such_tool'"),
    (["add", "--args", "@/nonexistent/args.json"], "bad_input", "cannot read arguments file"),
])
def test_caller_errors_exit_2_and_are_recorded_as_failed_calls(capsys, store_path, argv, kind, needle):
    rc, out = call(capsys, store_path, *argv)
    assert rc == 2 and not out["ok"] and out["error_kind"] == kind and needle in out["error"]
    run, rec = recorded(store_path, out["run_id"])
    assert run.status == "failed" and needle in run.error
    assert rec.error_kind == kind


def test_a_failing_tool_exits_1(capsys, store_path, tmp_path):
    rc, out = call(capsys, store_path, "mesh_incidence", "--args", json.dumps({"faces": str(tmp_path / "missing.npy")}))
    assert rc == 1 and out["error_kind"] == "exception" and "file not found" in out["error"]
    assert RunStore(store_path).get_run(out["run_id"]).status == "failed"


def test_no_store_records_nothing(capsys, tmp_path):
    path = tmp_path / "untouched.duckdb"
    assert main(["tool", "call", "add", "--args", '{"a": 1, "b": 1}', "--tools", MODULES, "--no-store", "--store", str(path)]) == 0
    assert "2.0" in capsys.readouterr().out and not path.exists()


def test_schemas_are_the_registry_schemas(capsys):
    registry = plugins.tool_registry(MODULES.split(","))
    assert main(["tools", "--json", *MODULES.split(",")]) == 0
    assert json.loads(capsys.readouterr().out) == registry.schemas
    assert main(["tool", "schema", "add", "--tools", MODULES]) == 0
    assert json.loads(capsys.readouterr().out) == registry.get("add").schema
    assert main(["tool", "schema", "nope", "--tools", MODULES]) == 2
    assert "no tool named 'nope'" in capsys.readouterr().err
    assert main(["tools", "--json", "no_such_module"]) == 2


def test_exit_code_of_the_real_command(tmp_path):
    """One real process: the exit status a shell sees, and a message on stderr, not a traceback."""
    proc = subprocess.run([sys.executable, "-m", "closedloop", "tool", "call", "add", "--args", "{oops",
                           "--tools", "arithmetic", "--store", str(tmp_path / "r.duckdb")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "malformed_json" in proc.stderr and "Traceback" not in proc.stderr
