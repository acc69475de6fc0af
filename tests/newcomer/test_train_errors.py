"""Trainer set-up as a newcomer meets it (issue 30, frictions 3 and 5-6): a name no plugin gives
fails with the config's other errors before any model loads (and leaves no run in the store),
GRPO's last line says how many steps it did, and ``accelerate launch`` starting fewer processes
than asked is said out loud (checked under a real ``accelerate launch``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from closedloop.cli import main
from closedloop.cli.train import done_line
from closedloop.store import RunStore


@pytest.mark.parametrize("key, value, said", [
    ("env", "tau-retail", "env 'tau-retail' is not a registered environment; available: calc"),
    ("graph", "reactt", "graph 'reactt' is not a registered graph; available:"),
])
def test_an_unknown_plugin_name_is_a_config_error_before_the_model_loads(tiny_model_path, tmp_path, capsys, key,
                                                                         value, said):
    store = tmp_path / "runs.duckdb"
    rc = main(["train", "grpo", "--set", f"model={tiny_model_path}", "--set", f"output_dir={tmp_path / 'out'}",
               "--set", f"store={store}", "--set", f"{key}={value}"])
    err = capsys.readouterr().err
    assert rc == 2 and said in err and "Traceback" not in err
    assert not store.exists() or RunStore(store).list_runs(limit=None) == []


def test_grpo_list_keys_names_only_environments_that_exist(capsys):
    assert main(["train", "grpo", "--list-keys"]) == 0
    env_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("env "))
    assert "tau-retail" not in env_line and "calc" in env_line


def test_the_last_line_of_grpo_says_its_steps(tmp_path):
    from closedloop.trainers.grpo import GRPOResult

    result = GRPOResult(output_dir=tmp_path, run_id="r1", steps=3, history=[{"reward": 0.5}, {"reward": 0.75}])
    assert done_line(result) == f"done: 3 steps · reward=0.75; model saved to {tmp_path}; run r1"
    assert "?" not in done_line(object()) and done_line(object()) == "done"


SCRIPT = textwrap.dedent("""
    import sys

    from closedloop.trainers.common import fewer_processes_warning, world_size

    # one write per line: two processes share the pipe, and print() writes its pieces one by one
    sys.stdout.write(f"world {world_size()} warning {fewer_processes_warning()}\\n")
    sys.stdout.flush()
""")


def _accelerate(tmp_path: Path, *flags: str) -> str:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    exe = str(Path(sys.executable).parent / "accelerate")
    done = subprocess.run([exe, "launch", *flags, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU machine accelerate starts them all")
def test_accelerate_launch_with_fewer_processes_than_asked_warns(tmp_path):
    out = _accelerate(tmp_path, "--num_processes", "2")
    assert "world 1 warning" in out and "asked for 2 processes but started 1" in out
    assert "--multi_gpu --num_processes 2" in out  # what to run instead
    two = _accelerate(tmp_path, "--multi_gpu", "--num_processes", "2")
    assert two.count("world 2 warning None") == 2
