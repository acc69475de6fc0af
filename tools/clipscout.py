"""ClipScout (FactGuard, paper 1): look closer at one span of a video, once.

The paper's tool takes a start and an end timestamp, samples four frames uniformly in that span,
tiles them as a 2×2 grid and resizes it under a maximum side; an agent may call it at most once
per sample. Here:

* **Sampling**: the midpoints of four equal sub-spans of ``[start, end]`` (uniform sampling as in
  TSN-style video pipelines; the endpoints themselves are avoided because ``end`` is often the
  video's duration, where no frame exists). ``end`` past the video is clamped to its duration and
  the report says so; a ``start`` at or past it is an error.
* **Decoding** through PyAV (FFmpeg): seek to the keyframe before each time, decode forward to the
  first frame at or after it.
* **Grid**: frames scaled to the first frame's size, tiled row-major (t0 t1 / t2 t3), the whole
  grid downscaled so its longest side is at most ``max_side`` (aspect ratio kept).
* **Once per sample**: :class:`ClipScout` is bound to one video; a second call returns a clear
  refusal (``ClipScoutRefused``), not a second grid. The tool form
  (:func:`make_clipscout_tool`) keeps that state per tool instance, so an environment builds one
  per sample.

:func:`write_video` writes frames to a small H.264/MPEG-4 file (synthetic data for tests and
demos).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Sequence

from pydantic import BaseModel, Field

from closedloop.tool import Tool

__all__ = ["ClipScout", "ClipScoutRefused", "ClipScoutReport", "sample_times", "read_frames", "tile_2x2",
           "video_duration", "write_video", "make_clipscout_tool", "N_FRAMES", "DEFAULT_MAX_SIDE"]

N_FRAMES = 4
DEFAULT_MAX_SIDE = 768


class ClipScoutRefused(RuntimeError):
    """The one ClipScout call of this sample was already made."""


class ClipScoutReport(BaseModel):
    """What the agent is told beside the grid image."""

    grid_path: str | None = None
    times_s: list[float]
    span_s: tuple[float, float]
    clamped: bool = False
    width: int
    height: int
    sha256: str


def sample_times(start: float, end: float, n: int = N_FRAMES) -> list[float]:
    """Midpoints of ``n`` equal sub-spans of ``[start, end]``."""
    if not end > start:
        raise ValueError(f"end ({end:g} s) must be after start ({start:g} s)")
    step = (end - start) / n
    return [start + (i + 0.5) * step for i in range(n)]


def video_duration(path: str | Path) -> float:
    """Seconds, from the container (or the video stream) metadata."""
    import av

    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        if stream.duration is not None and stream.time_base is not None:
            return float(stream.duration * stream.time_base)
        if c.duration is not None:
            return c.duration / 1_000_000
    raise ValueError(f"{path}: the video has no duration metadata")


def read_frames(path: str | Path, times: Sequence[float]) -> list[Any]:
    """PIL images of the first frame at or after each time (the last frame if past the end)."""
    import av

    frames = []
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        tb = stream.time_base
        if tb is None:
            raise ValueError(f"{path}: the video stream has no time base")
        for t in times:
            c.seek(int(t / tb), stream=stream, backward=True, any_frame=False)
            chosen = None
            for frame in c.decode(stream):
                chosen = frame
                if frame.pts is not None and float(frame.pts * tb) >= t - 1e-6:
                    break
            if chosen is None:
                raise ValueError(f"{path}: no frame could be decoded near {t:.3f} s")
            frames.append(chosen.to_image())
    return frames


def tile_2x2(frames: Sequence[Any], max_side: int = DEFAULT_MAX_SIDE) -> Any:
    """Four frames as one 2×2 grid (row-major), downscaled so the longest side is ≤ ``max_side``."""
    from PIL import Image

    if len(frames) != 4:
        raise ValueError(f"a 2x2 grid needs 4 frames, got {len(frames)}")
    if max_side < 2:
        raise ValueError("max_side must be at least 2 pixels")
    w, h = frames[0].size
    grid = Image.new("RGB", (2 * w, 2 * h))
    for i, f in enumerate(frames):
        grid.paste(f.convert("RGB").resize((w, h)), ((i % 2) * w, (i // 2) * h))
    longest = max(grid.size)
    if longest > max_side:
        scale = max_side / longest
        grid = grid.resize((max(1, round(grid.width * scale)), max(1, round(grid.height * scale))),
                           Image.Resampling.BILINEAR)
    return grid


@dataclass
class ClipScout:
    """ClipScout bound to one sample's video: one call, then refusals."""

    video: str | Path
    max_side: int = DEFAULT_MAX_SIDE
    calls: int = field(default=0, init=False)

    def __call__(self, start: float, end: float) -> tuple[Any, ClipScoutReport]:
        self.calls += 1
        if self.calls > 1:
            raise ClipScoutRefused("ClipScout was already used for this video: it can be called once per sample. "
                                   "Answer from the evidence you have.")
        if start < 0:
            raise ValueError(f"start must be >= 0 s, got {start:g}")
        duration = video_duration(self.video)
        if start >= duration:
            raise ValueError(f"start {start:g} s is at or past the end of the video ({duration:.2f} s)")
        clamped = end > duration
        end = min(end, duration)
        times = sample_times(start, end)
        grid = tile_2x2(read_frames(self.video, times), self.max_side)
        digest = hashlib.sha256(grid.tobytes()).hexdigest()
        return grid, ClipScoutReport(times_s=[round(t, 3) for t in times], span_s=(start, end), clamped=clamped,
                                     width=grid.width, height=grid.height, sha256=digest)


def make_clipscout_tool(video: str | Path, *, out_dir: str | Path, max_side: int = DEFAULT_MAX_SIDE,
                        name: str = "clipscout") -> Tool:
    """The tool form for one sample: writes the grid as PNG under ``out_dir`` and returns the report
    (``grid_path`` set); a graph attaches the image to the conversation. A second call is refused."""
    scout = ClipScout(video, max_side=max_side)
    out = Path(out_dir)

    def clipscout(start: Annotated[float, Field(ge=0)], end: Annotated[float, Field(gt=0)]) -> ClipScoutReport:
        """Look closer at one span of the video: four frames sampled uniformly between start and end, tiled 2x2. Can be called once per video.

        Args:
            start: Span start, in seconds.
            end: Span end, in seconds (past the end of the video: clamped to it).
        """
        grid, report = scout(start, end)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"clipscout-{report.sha256[:16]}.png"
        grid.save(path)
        return report.model_copy(update={"grid_path": str(path)})

    return Tool(clipscout, name=name, timeout_s=60.0)


def write_video(path: str | Path, frames: Sequence[Any], fps: int = 8, audio: Any = None,
                audio_rate: int = 16_000) -> Path:
    """Frames (PIL images or HxWx3 uint8 arrays, even sizes) to an MPEG-4 file at ``fps``; with
    ``audio`` (mono float32 in [-1, 1] at ``audio_rate``) an AAC track too."""
    import av
    import numpy as np

    path = Path(path)
    arrays = [np.asarray(f.convert("RGB")) if hasattr(f, "convert") else np.asarray(f, dtype=np.uint8)
              for f in frames]
    if not arrays:
        raise ValueError("no frames to write")
    h, w = arrays[0].shape[:2]
    if h % 2 or w % 2:
        raise ValueError(f"frame size must be even for yuv420p, got {w}x{h}")
    with av.open(str(path), mode="w") as c:
        stream = c.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.time_base = Fraction(1, fps)
        track = None
        if audio is not None:  # every stream exists before the first packet is written
            track = c.add_stream("aac", rate=audio_rate)
            track.layout = "mono"
        for i, a in enumerate(arrays):
            frame = av.VideoFrame.from_ndarray(a, format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                c.mux(packet)
        for packet in stream.encode():
            c.mux(packet)
        if track is not None:
            samples = np.asarray(audio, dtype=np.float32).reshape(1, -1)
            block = 1024
            for i in range(0, samples.shape[1], block):
                aframe = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[:, i:i + block]), format="fltp",
                                                    layout="mono")
                aframe.sample_rate, aframe.pts = audio_rate, i
                for packet in track.encode(aframe):
                    c.mux(packet)
            for packet in track.encode():
                c.mux(packet)
    return path
