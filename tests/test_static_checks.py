"""Lint and type checks run with the tests, so CI (which runs the README's test command) fails on
them: ruff (syntax errors and pyflakes: undefined names, unused imports and variables, broken
``__all__``) over the whole repository, and mypy over the core (``closedloop/``) at the level in
``pyproject.toml`` (modules listed there with ``ignore_errors`` are the known debt; a new module
is checked from its first commit)."""

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


def test_mypy_core():
    proc = subprocess.run(_tool("mypy") + ["closedloop"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
