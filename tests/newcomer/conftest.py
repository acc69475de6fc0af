"""Fixtures of the newcomer tests: one build cache for the tiny model, shared by every
``closedloop model tiny`` a README block runs and by the preset test, so the ``agent`` preset is
built once per test session (and kept in pytest's cache between sessions)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # docblocks, beside the tests


@pytest.fixture(scope="session")
def tiny_build_cache(request) -> Path:
    """A ``CLOSEDLOOP_TINY_CACHE`` folder in pytest's cache (per machine, not per run); not named
    ``closedloop-tiny-*``, which tests/conftest.py prunes when it rebuilds its own tiny model."""
    return Path(request.config.cache.mkdir("tiny-build-cache"))
