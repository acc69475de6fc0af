"""Array-path arguments stay inside the working root, and errors never probe the disk.

Issue 9 (6): array-path arguments read any ``.npy``/``.npz``/``.safetensors`` file on the machine
(absolute paths, ``../``, ``~``), and errors revealed whether a file existed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from closedloop import plugins
from closedloop.artifacts import ArtifactError, load_array, save_array
from closedloop.paths import PathOutsideRoot, resolve_path, working_roots


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """cwd = work/, artifacts = arts/, a secret array beside them (outside both)."""
    work, arts, outside = tmp_path / "work", tmp_path / "arts", tmp_path / "outside"
    for d in (work, arts, outside):
        d.mkdir()
    np.save(outside / "secret.npy", np.arange(3.0))
    np.save(work / "mine.npy", np.ones(2))
    (work / "link.npy").symlink_to(outside / "secret.npy")
    monkeypatch.chdir(work)
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(arts))
    monkeypatch.delenv("CLOSEDLOOP_WORKING_ROOTS", raising=False)
    monkeypatch.setenv("HOME", str(outside))
    return work, arts, outside


def test_default_roots_are_the_artifacts_and_the_current_directory(layout):
    work, arts, _ = layout
    assert working_roots() == [arts.resolve(), work.resolve()]
    assert np.array_equal(load_array("mine.npy"), np.ones(2))
    ref = save_array(np.zeros((10, 10)))  # a tool's output comes back in by its absolute path
    assert load_array(ref.path).shape == (10, 10)


@pytest.mark.parametrize("escape", ["{outside}/secret.npy", "../outside/secret.npy", "~/secret.npy", "link.npy",
                                    "{outside}/missing.npy", "../outside/missing.npy", "~/missing.npy",
                                    "/etc/passwd.npy", "mine.npy/../../outside/secret.npy", "a\x00b.npy"])
def test_escapes_are_refused_with_one_message_whether_or_not_the_file_exists(layout, escape):
    _, _, outside = layout
    value = escape.format(outside=outside)
    with pytest.raises(ArtifactError) as info:
        load_array(value, name="x")
    message = str(info.value)
    assert "outside the working root" in message
    assert "not found" not in message and "cannot read" not in message
    with pytest.raises(PathOutsideRoot):
        resolve_path(value)


def test_existing_and_missing_outside_files_give_identical_errors(layout):
    _, _, outside = layout

    def error(path):
        with pytest.raises(ArtifactError) as info:
            load_array(path, name="x")
        return str(info.value).replace(path, "<arg>")

    assert error(str(outside / "secret.npy")) == error(str(outside / "nothing.npy"))
    assert error("../outside/secret.npy") == error("../outside/nothing.npy")


def test_the_root_is_widened_by_the_environment(layout, monkeypatch):
    _, _, outside = layout
    monkeypatch.setenv("CLOSEDLOOP_WORKING_ROOTS", str(outside))
    assert np.array_equal(load_array(str(outside / "secret.npy")), np.arange(3.0))
    assert np.array_equal(load_array("link.npy"), np.arange(3.0))


async def test_every_path_reading_tool_is_confined(layout):
    _, _, outside = layout
    registry = plugins.tool_registry()
    secret = str(outside / "secret.npy")
    calls = [("mesh_incidence", {"faces": secret}), ("compatibility_certificate", {"d0": secret, "d1": [[1.0]]}),
             ("hodge_spectrum", {"d0": str(outside / "op.npz"), "d1": [[1.0]]}),
             ("conditional_krr_fit", {"dataset": str(outside / "ds.npz")}),
             ("residual_kernel_spectrum", {"dataset": "../outside/ds.npz"}),
             ("culture_mt_notes", {"notes_path": str(outside / "notes.jsonl")}),
             ("phalar_cqt", {"audio": str(outside / "a.wav")}),
             ("arbg_snis", {"energies": secret, "log_q": [0.0, 0.0, 0.0]})]
    for name, args in calls:
        if name not in registry:
            continue
        t = registry.get(name).with_options(timeout_s=None)  # the refusal is the subject, on any load
        if name == "phalar_cqt" and "audio" not in t.parameters["properties"]:
            continue
        r = await t.run(args)
        assert not r.ok and "outside the working root" in r.error, (name, r.error)
        assert "not found" not in r.error
    assert os.path.exists(secret)


def test_a_server_directory_can_be_allowed_for_the_process(layout, monkeypatch):
    import closedloop.paths as paths

    _, _, outside = layout
    monkeypatch.setattr(paths, "_ALLOWED", [])
    with pytest.raises(ArtifactError):
        load_array(str(outside / "secret.npy"))
    paths.allow_root(outside)  # what `closedloop mcp serve --workdir DIR` does
    assert np.array_equal(load_array(str(outside / "secret.npy")), np.arange(3.0))
