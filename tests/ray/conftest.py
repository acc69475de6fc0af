"""One real local Ray cluster (2 CPUs) for the tests of this folder, started once and stopped after
its last test; without Ray installed the folder is skipped (``local`` needs no Ray)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="package")
def ray_cluster():
    """The cluster's address (a second driver, e.g. a ``closedloop eval`` subprocess, joins it).

    A short temp dir (Ray's socket paths must stay under 107 bytes), no dashboard, a small object
    store: the suite runs on a 2-core, 24 GiB machine."""
    temp = tempfile.mkdtemp(prefix="clray-")
    context = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024,
                       log_to_driver=False, _temp_dir=temp)
    try:
        yield context.address_info["address"]
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="package")
def tau_root() -> Path:
    """The real tau2 data (retail): $TAU2_DATA_DIR, else ../shared/anchors beside the repository."""
    for cand in (os.environ.get("TAU2_DATA_DIR"), REPO.parent / "shared" / "anchors"):
        if cand and (Path(cand) / "tau2" / "domains" / "retail" / "tasks.json").is_file():
            return Path(cand)
    pytest.skip("τ anchors not present")
