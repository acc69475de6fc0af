"""Fixtures for the τ tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from closedloop.evals.tau import load_domain

from ._support import ANCHORS, mini_db, mini_tasks, write_root


@pytest.fixture
def mini_root(tmp_path: Path) -> Path:
    return write_root(tmp_path, mini_db(), mini_tasks(), {"train": ["cancel", "noop"]})


@pytest.fixture
def mini(mini_root: Path):
    return load_domain("retail", mini_root)


@pytest.fixture(scope="session")
def anchors_retail():
    if not (ANCHORS / "tau2" / "domains" / "retail" / "tasks.json").is_file():
        pytest.skip("τ anchors not present")
    return load_domain("retail", ANCHORS)


