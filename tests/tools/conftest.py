"""Fixtures of the paper tools' tests: results without timeouts, models inside the working root."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from closedloop import plugins
from closedloop.paths import ROOTS_ENV


@pytest.fixture(autouse=True)
def _results_not_timeouts(monkeypatch):
    """These tests check what tools compute, never their timeouts: a call that takes minutes on a
    loaded machine (a sandboxed tool starts a fresh interpreter) must not become a timeout. Every
    registered tool runs without one here; tests of timeouts live in tests/reliability and
    tests/core, with work that cannot finish."""
    for t in plugins.tool_registry():
        monkeypatch.setattr(t, "timeout_s", None)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model_path: Path) -> Iterator[Path]:
    """The session's tiny model, its directory made part of the working root: a model argument must
    name a checkpoint inside it (closedloop.tool_models), as a user's would after widening the root."""
    previous = os.environ.get(ROOTS_ENV)
    os.environ[ROOTS_ENV] = os.pathsep.join(p for p in (previous, str(tiny_model_path)) if p)
    yield tiny_model_path
    if previous is None:
        os.environ.pop(ROOTS_ENV, None)
    else:
        os.environ[ROOTS_ENV] = previous
