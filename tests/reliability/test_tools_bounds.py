"""Arguments the schemas allow cannot exhaust the machine; artifacts do not pile up forever.

Issue 9 (3): ``pc_bp_alignment(width=4096, depth=256)`` allocated about 32 GiB in 128 MiB steps;
``grid_mesh_operators(n=2000)`` wrote 345 MB per call that nothing removed; a 2 MB ``.npz``
unpacked to 2 GiB. Issue 26: the size budget did not bound a burst (4 x ``grid_mesh_operators
{"n": 700}`` with a 20 MB budget left 160.8 MB: files younger than 10 minutes were never pruned).
"""

from __future__ import annotations

import asyncio
import io
import os
import threading
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
    r = await registry.get("pc_bp_alignment").with_options(timeout_s=None).run({"width": 16, "depth": 3})
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


def _usage(directory) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if not p.name.startswith("."))


def test_saving_past_the_budget_prunes_old_artifacts_first(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path))
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS_MAX_MB", "3")
    old = time.time() - 3600
    refs = []
    for i in range(6):
        refs.append(save_array(np.zeros(2**17), prefix=f"b{i}"))  # 1 MiB each
        os.utime(refs[-1].path, (old + i, old + i))
        assert _usage(tmp_path) <= 3 * 2**20  # never over, not even for one save
    assert [os.path.exists(r.path) for r in refs] == [False] * 4 + [True] * 2  # the oldest went first


def test_a_burst_of_young_artifacts_is_refused_at_the_budget(tmp_path, monkeypatch):
    """Eight writers at once, none of whose files may be pruned (all young): the budget holds,
    the refusals say why, and no half-written file is left behind."""
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path))
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS_MAX_MB", "3.5")
    outcomes: list[object] = []
    start = threading.Barrier(8)

    def writer(i: int) -> None:
        start.wait()
        try:
            outcomes.append(save_array(np.full(2**17, float(i)), prefix=f"burst{i}"))  # 1 MiB each
        except ArtifactError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    saved = [o for o in outcomes if not isinstance(o, ArtifactError)]
    refused = [o for o in outcomes if isinstance(o, ArtifactError)]
    assert len(saved) == 3 and len(refused) == 5  # 3 x (1 MiB + header) fit in 3.5 MiB, a 4th never does
    assert all("cannot take this output" in str(e) and "younger than 10 minutes" in str(e) for e in refused)
    assert _usage(tmp_path) <= 3.5 * 2**20
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        sorted(os.path.basename(r.path) for r in saved)  # no .partial file survives a refusal
    for r in saved:  # each saved file holds its own writer's data, whole
        i = int(os.path.basename(r.path).removeprefix("burst").split("-")[0])
        assert np.array_equal(load_array(r.path), np.full(2**17, float(i)))


async def test_sandboxed_tools_in_a_burst_keep_the_budget(tmp_path, monkeypatch, registry):
    """The issue's reproduction: four grid_mesh_operators at once, each in its own process. Outputs
    bigger than the whole budget are refused before anything is written; outputs that fit one
    at a time but not together stop at the budget (the reservation is shared across processes)."""
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path))
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS_MAX_MB", "20")
    grid = registry.get("grid_mesh_operators").with_options(timeout_s=None)  # results are the subject
    results = await asyncio.gather(*[grid.run({"n": 700}) for _ in range(4)])
    assert all(r.error_kind == "exception" and "more than the artifacts directory's whole budget" in r.error
               for r in results), [r.error for r in results]
    assert _usage(tmp_path) == 0
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS_MAX_MB", "8")  # one n=200 call keeps 3.3 MiB; four cannot all fit
    results = await asyncio.gather(*[grid.run({"n": 200}) for _ in range(4)])
    assert all(r.ok or "cannot take this output" in r.error for r in results), [r.error for r in results]
    assert _usage(tmp_path) <= 8 * 2**20
    assert not any(p.name.count(".partial") for p in tmp_path.iterdir())


def test_runs_prune_also_prunes_artifacts(tmp_path, monkeypatch, capsys):
    from closedloop.cli import main

    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path / "arts"))
    old, new = save_array(np.zeros(100), prefix="old"), save_array(np.zeros(100), prefix="new")
    past = time.time() - 3 * 86400
    os.utime(old.path, (past, past))
    assert main(["runs", "prune", "--older-than", "1d", "--artifacts", "--store", str(tmp_path / "r.duckdb")]) == 0
    assert "deleted 1 artifact(s)" in capsys.readouterr().out
    assert not os.path.exists(old.path) and os.path.exists(new.path)
