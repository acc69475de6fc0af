"""ClipScout (paper 1, checkable (b)): one 2×2 grid of four uniformly sampled frames, then a refusal."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from PIL import Image

from closedloop.tools.clipscout import (ClipScout, ClipScoutRefused, make_clipscout_tool, read_frames, sample_times,
                                        tile_2x2, video_duration, write_video)

FPS = 8
N = 40  # 5 s


def color(i: int) -> tuple[int, int, int]:
    """A distinct, codec-robust colour per frame index."""
    return ((i * 6) % 256, 255 - (i * 6) % 256, 128)


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    frames = [Image.new("RGB", (64, 48), color(i)) for i in range(N)]
    return write_video(tmp_path_factory.mktemp("v") / "clip.mp4", frames, fps=FPS)


def test_uniform_sampling_is_midpoints_of_four_subspans():
    assert sample_times(0, 4) == [0.5, 1.5, 2.5, 3.5]
    assert sample_times(2, 3) == pytest.approx([2.125, 2.375, 2.625, 2.875])
    with pytest.raises(ValueError, match="must be after start"):
        sample_times(3, 3)


def test_frames_are_the_ones_at_the_sampled_times(video):
    assert video_duration(video) == pytest.approx(N / FPS)
    times = sample_times(1.0, 3.0)
    for t, img in zip(times, read_frames(video, times)):
        expected = np.array(color(int(round(t * FPS))))
        assert np.abs(np.asarray(img).reshape(-1, 3).mean(0) - expected).max() < 8


def test_one_grid_of_four_quadrants_under_the_max_side_then_a_refusal(video):
    scout = ClipScout(video, max_side=100)
    grid, rep = scout(1.0, 3.0)
    assert (grid.width, grid.height) == (100, 75) and max(grid.size) <= 100  # 128x96 scaled, aspect kept
    a = np.asarray(grid).astype(float)
    h, w = a.shape[0] // 2, a.shape[1] // 2
    quads = [a[:h, :w], a[:h, w:], a[h:, :w], a[h:, w:]]  # row-major: t0 t1 / t2 t3
    for q, t in zip(quads, rep.times_s):
        inner = q[4:-4, 4:-4].reshape(-1, 3).mean(0)
        assert np.abs(inner - np.array(color(int(round(t * FPS))))).max() < 10
    with pytest.raises(ClipScoutRefused, match="once per sample"):
        scout(0.0, 1.0)


def test_tool_form_writes_the_grid_clamps_the_end_and_refuses_a_second_call(video, tmp_path):
    tool = make_clipscout_tool(video, out_dir=tmp_path, max_side=64)
    first = asyncio.run(tool.run({"start": 4.0, "end": 99.0}))
    assert first.ok, first.content
    rep = json.loads(first.content)
    assert rep["clamped"] and rep["span_s"] == [4.0, N / FPS]
    assert Image.open(rep["grid_path"]).size == (rep["width"], rep["height"]) and max(rep["width"], rep["height"]) == 64
    second = asyncio.run(tool.run({"start": 0.0, "end": 1.0}))
    assert not second.ok and "once per sample" in second.content
    fresh = make_clipscout_tool(video, out_dir=tmp_path)  # another sample: another budget
    late = asyncio.run(fresh.run({"start": 6.0, "end": 7.0}))
    assert not late.ok and "past the end of the video" in late.content
    bad = asyncio.run(make_clipscout_tool(video, out_dir=tmp_path).run({"start": -1, "end": 1}))
    assert not bad.ok and bad.error_kind == "invalid_arguments"


def test_tile_needs_four_frames():
    with pytest.raises(ValueError, match="needs 4 frames"):
        tile_2x2([Image.new("RGB", (4, 4))] * 3)
