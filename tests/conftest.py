"""Session-wide fixtures: the tiny tool-calling model, built once per test session (offline, CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def anchors_root() -> Path | None:
    """The real tau2 data shipped beside the repository (../shared/anchors), or $TAU2_DATA_DIR."""
    for cand in (os.environ.get("TAU2_DATA_DIR"), REPO.parent / "shared" / "anchors"):
        if cand and (Path(cand) / "tau2" / "domains" / "retail").is_dir():
            return Path(cand)
    return None


TINY_STEPS = 300  # the default is 500; 300 already gives well-formed calls and halves the build


@pytest.fixture(scope="session")
def tiny_model_path(request) -> Path:
    """The tiny model, built once per version of ``tiny.py`` and kept in pytest's cache
    (``CLOSEDLOOP_TINY_MODEL=<dir>`` points the tests at a prebuilt one instead)."""
    import hashlib
    import shutil

    import torch

    from closedloop.models import tiny
    from closedloop.models.tiny import TINY_CONFIG_FILE, build_tiny_model

    # A 2-core machine: extra OpenMP threads spin against each other and slow everything down.
    torch.set_num_threads(1)
    if os.environ.get("CLOSEDLOOP_TINY_MODEL"):
        return Path(os.environ["CLOSEDLOOP_TINY_MODEL"])
    version = hashlib.sha256(Path(tiny.__file__).read_bytes()).hexdigest()[:12]
    cached = Path(request.config.cache.mkdir(f"closedloop-tiny-{TINY_STEPS}-{version}"))
    if not (cached / TINY_CONFIG_FILE).exists():  # written last: its presence means a whole build
        staging = cached.with_name(cached.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        build_tiny_model(staging, seed=0, train_steps=TINY_STEPS)
        shutil.rmtree(cached)
        staging.rename(cached)
        for stale in cached.parent.glob("closedloop-tiny-*"):
            if stale != cached and not stale.name.endswith(".building"):
                shutil.rmtree(stale, ignore_errors=True)
    return cached


@pytest.fixture(scope="session")
def tiny_client(tiny_model_path):
    from closedloop.models.hf import HFClient

    return HFClient.from_pretrained(tiny_model_path)
