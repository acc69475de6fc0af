"""Arguments the schemas allow cannot exhaust the machine; artifacts do not pile up forever.

Issue 9 (3): ``pc_bp_alignment(width=4096, depth=256)`` allocated about 32 GiB in 128 MiB steps;
``grid_mesh_operators(n=2000)`` wrote 345 MB per call that nothing removed; a 2 MB ``.npz``
unpacked to 2 GiB.
"""

from __future__ import annotations

import io
import os
import time
import zipfile
from datetime import timedelta

import numpy as np
import pytest

from closedloop import plugins
from closedloop.artifacts import ArtifactError, load_array, prune_artifacts, save_array


@pytest.fixture(scope="module")
def registry():
    return plugins.tool_registry(["predictive_coding", "mesh_certificate", "spike_dice_attention"])


@pytest.mark.parametrize("name, args, kind, fragment", [
    ("pc_bp_alignment", {"width": 4096, "depth": 256}, "resource_limit", "would need about 193.0 GiB"),
    ("pc_width_sweep", {"widths": [8, 4096], "depths": [2, 256]}, "resource_limit", "over its memory ceiling"),
    ("spike_attention_density_bias", {"batch": 4096, "heads": 4096, "tokens": 4096, "dim": 4096},
     "resource_limit", "over its memory ceiling"),
    ("grid_mesh_operators", {"n": 2001}, "invalid_arguments", "less than or equal to 2000"),
    ("mesh_incidence", {"faces": [[0, 1, 10**12]]}, "exception", "at most 10000000 vertices"),
])
async def test_oversized_arguments_are_refused_before_any_allocation(registry, name, args, kind, fragment):
    r = await registry.get(name).run(args)  # resource_limit / invalid_arguments: refused before the call
    assert not r.ok and r.error_kind == kind and fragment in r.error, r.error


async def test_a_call_within_bounds_still_runs(registry):
    r = await registry.get("pc_bp_alignment").run({"width": 16, "depth": 3})
    assert r.ok, r.error


def _npz_bomb(path, claimed_shape=(2**28,)):
    """A small .npz whose member header claims a 2 GiB float64 array (the data is zeros, compressed)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": claimed_shape})
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        with zf.open("x.npy", "w", force_zip64=True) as f:
            f.write(header.getvalue())
            chunk = bytes(2**20)
            for _ in range(64):  # 64 MiB of zeros: the file stays small, the claim is 2 GiB
                f.write(chunk)
    return path


def test_a_decompression_bomb_is_refused_from_its_header(tmp_path):
    bomb = _npz_bomb(tmp_path / "bomb.npz")
    assert bomb.stat().st_size < 2 * 2**20  # the file on disk is under 2 MB
    with pytest.raises(ArtifactError, match="would unpack to 2048 MiB"):
        load_array(str(bomb))


def test_the_array_limit_is_configurable(tmp_path, monkeypatch):
    np.save(tmp_path / "a.npy", np.zeros(300_000))  # 2.3 MiB
    monkeypatch.setenv("CLOSEDLOOP_MAX_ARRAY_MB", "1")
    with pytest.raises(ArtifactError, match="over the limit of 1 MiB"):
        load_array(str(tmp_path / "a.npy"))
    monkeypatch.setenv("CLOSEDLOOP_MAX_ARRAY_MB", "10")
    assert load_array(str(tmp_path / "a.npy")).shape == (300_000,)


def test_artifacts_have_a_retention_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path))
    refs = [save_array(np.zeros(2**17), prefix=f"a{i}") for i in range(4)]  # 1 MiB each
    old = time.time() - 3600
    for i, ref in enumerate(refs[:3]):
        os.utime(ref.path, (old + i, old + i))  # three old ones, the newest one just written
    report = prune_artifacts(max_total_mb=2.5)
    assert report.removed == 2 and [os.path.exists(r.path) for r in refs] == [False, False, True, True]
    report = prune_artifacts(older_than=timedelta(minutes=30))
    assert report.removed == 1 and os.path.exists(refs[3].path)  # young files are never removed


def test_saving_past_the_budget_prunes_automatically(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path))
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS_MAX_MB", "3")
    old = time.time() - 3600
    for i in range(6):
        ref = save_array(np.zeros(2**17), prefix=f"b{i}")
        os.utime(ref.path, (old + i, old + i))
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total <= 3 * 2**20 + 2**20  # at most one save past the budget before the next check


def test_runs_prune_also_prunes_artifacts(tmp_path, monkeypatch, capsys):
    from closedloop.cli import main

    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path / "arts"))
    old, new = save_array(np.zeros(100), prefix="old"), save_array(np.zeros(100), prefix="new")
    past = time.time() - 3 * 86400
    os.utime(old.path, (past, past))
    assert main(["runs", "prune", "--older-than", "1d", "--artifacts", "--store", str(tmp_path / "r.duckdb")]) == 0
    assert "deleted 1 artifact(s)" in capsys.readouterr().out
    assert not os.path.exists(old.path) and os.path.exists(new.path)
