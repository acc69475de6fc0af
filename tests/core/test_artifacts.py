"""Arrays travel as artifact paths or small inline lists, with clear errors."""

import numpy as np
import pytest
from safetensors.numpy import save_file

from closedloop.artifacts import ArrayRef, ArtifactError, array_output, load_array


def test_load_every_format(tmp_path):
    a = np.arange(6.0).reshape(2, 3)
    np.save(tmp_path / "a.npy", a)
    np.savez(tmp_path / "b.npz", x=a, y=a + 1)
    save_file({"w": a}, str(tmp_path / "c.safetensors"))
    assert np.array_equal(load_array(str(tmp_path / "a.npy")), a)
    assert np.array_equal(load_array(str(tmp_path / "b.npz"), key="y"), a + 1)
    assert np.array_equal(load_array(str(tmp_path / "c.safetensors")), a)
    assert np.array_equal(load_array([[0, 1, 2], [3, 4, 5]]), a)


@pytest.mark.parametrize("value, fragment", [
    ("/nonexistent/x.npy", "outside the working root"),  # never "not found": that would probe the disk
    ("missing-in-cwd.npy", "not found"),
    ([[1, 2], [3]], "rectangular"),
    ([1.0, float("nan")], "NaN"),
])
def test_errors(value, fragment):
    with pytest.raises(ArtifactError, match=fragment):
        load_array(value)


def test_npz_needs_a_key_when_ambiguous(tmp_path):
    np.savez(tmp_path / "b.npz", x=np.zeros(2), y=np.ones(2))
    with pytest.raises(ArtifactError, match="name one with a key"):
        load_array(str(tmp_path / "b.npz"))


def test_small_outputs_inline_large_ones_saved(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path))
    assert array_output(np.eye(2)) == [[1.0, 0.0], [0.0, 1.0]]
    ref = array_output(np.ones((100, 3)))
    assert isinstance(ref, ArrayRef) and ref.shape == [100, 3]
    assert np.array_equal(load_array(ref.path), np.ones((100, 3)))
