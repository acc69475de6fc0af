"""A subcommand imports its machinery only when it runs: the listing commands and ``--help`` load
no model, graph, store or tool module (checked on ``sys.modules`` of a fresh process, not timed;
``benchmarks/bench_cli_startup.py`` measures the CPU time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from closedloop import plugins

HEAVY = ("torch", "transformers", "duckdb", "langgraph", "scipy", "sacrebleu", "av", "closedloop.trainers")
RUNNER = """
import contextlib, io, json, sys
from closedloop.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "out": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def run_cli(*argv: str) -> dict:
    """``closedloop ARGV`` in a fresh interpreter: its exit code, stdout and the modules it imported."""
    env = {**os.environ, "COLUMNS": "400"}  # rich tables unwrapped, one row per line
    done = subprocess.run([sys.executable, "-c", RUNNER, *argv], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def imported(result: dict, *prefixes: str) -> list[str]:
    return [m for m in result["modules"] if any(m == p or m.startswith(p + ".") for p in prefixes)]


@pytest.mark.parametrize("argv", [["--help"], ["tools"], ["graphs"], ["plugins"], ["train", "--help"],
                                  ["eval", "--help"]])
def test_listing_commands_import_no_machinery(argv):
    result = run_cli(*argv)
    assert result["code"] == 0
    assert imported(result, *HEAVY) == []


def test_tools_and_graphs_list_names_modules_and_descriptions():
    tools = run_cli("tools")["out"]
    for name, module, description in (("add", "arithmetic", "Add two numbers."),
                                      ("phalar_cqt", "phalar", "PHALAR's constant-Q front end")):
        assert name in tools and module in tools and description in tools
    graphs = run_cli("graphs")["out"]
    assert all(name in graphs for name in plugins.registry("graphs").names())
    assert "the reference tool-calling agent graph" in graphs


def test_a_benchmark_builds_only_its_own_parser():
    result = run_cli("eval", "tau", "--help")
    assert result["code"] == 0 and "--domain" in result["out"]
    assert imported(result, "closedloop.evals.kernelbench", "closedloop.evals.factguard", "closedloop.evals.tau.runner",
                    "rich", *HEAVY) == []


def test_train_help_lists_every_trainer():
    out = run_cli("train", "--help")["out"]
    for name in plugins.registry("trainers").names():
        assert f"\n  {name} " in out
    assert "Supervised fine-tuning" in out


def test_version_unknown_and_missing_commands():
    done = subprocess.run([sys.executable, "-m", "closedloop", "--version"], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == f"closedloop {version('closedloop')}"
    for argv, message in ((["nosuch"], "invalid choice: 'nosuch'"), ([], "the following arguments are required")):
        done = subprocess.run([sys.executable, "-m", "closedloop", *argv], capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and message in done.stderr
