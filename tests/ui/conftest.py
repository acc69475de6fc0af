"""Fixtures of the viewer's tests: a sample store, the viewer served over real HTTP on loopback,
and a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by Selenium;
``.ci/run`` installs them, and without them the browser tests skip saying so)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import sample_store  # noqa: E402
from ui_support import ARTIFACTS, ServedUI, start_browser  # noqa: E402


@pytest.fixture(scope="session")
def sample(tmp_path_factory) -> sample_store.SampleStore:
    root = tmp_path_factory.mktemp("ui-sample")
    return sample_store.build(root / "runs.duckdb", root / "model")


@pytest.fixture(scope="session")
def served(sample):
    with ServedUI(store=str(sample.path), poll_ms=100) as ui:
        yield ui


@pytest.fixture(scope="session")
def browser():
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must not try to download a driver
    drv = start_browser()
    drv.set_page_load_timeout(120)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield drv
    drv.quit()


