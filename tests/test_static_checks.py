"""Lint and type checks run with the tests, so CI (which runs the README's test command) fails on
them: ruff (syntax errors and pyflakes: undefined names, unused imports and variables, broken
``__all__``) over the whole repository, and mypy (with the pydantic plugin) over the whole library
exactly as ``python -m mypy`` runs it from ``pyproject.toml``: the ``closedloop`` package, whose
top-level folders are linked in, so ``closedloop.trainers`` and the rest are checked like the core."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str) -> list[str]:
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed (pip install -e .[test])")
    return [exe]


def test_ruff():
    proc = subprocess.run(_tool("ruff") + ["check", "--quiet", "."], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_mypy_library():
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_namespace_is_visible_to_static_tools(tmp_path):
    """``closedloop.<folder>`` resolves by path alone (no import hook), so mypy types a trainer's
    function instead of reading it as ``Any``."""
    for folder in ("agents", "tools", "graphs", "trainers", "memory", "evals"):
        link = REPO / "closedloop" / folder
        assert link.is_dir() and link.resolve() == (REPO / folder).resolve(), folder
    probe = tmp_path / "probe.py"
    probe.write_text("from closedloop.trainers.losses import grpo_loss\nreveal_type(grpo_loss)\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                           "--config-file", str(REPO / "pyproject.toml"), str(probe)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    revealed = [line for line in proc.stdout.splitlines() if "Revealed type" in line]
    assert revealed and "def (" in revealed[0], proc.stdout[-2000:]
