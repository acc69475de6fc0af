"""STARCaster's evaluation contract: identity, lip sync, static drift and FVD for talking heads.

Paper 14 (STARCaster, arXiv 2512.13247; research/papers.md §14) is an autoregressive video
diffusion model driven by audio plus an identity embedding. No code or weights are public, so
this module is the *contract* a generator is judged by, not the generator: anything that
satisfies :class:`TalkingHeadGenerator` can be scored, and every feature network (ArcFace,
SyncNet, I3D) is pluggable through a small Protocol, because their weights cannot be bundled.

Metrics (why each exists):

* identity cosine — cos(e_t, e_ref) of each frame's face embedding with the reference identity
  embedding (ArcFace in the paper); the paper trains "soft" identity constraints, so we report
  the mean *and* the worst frame.
* audio-visual sync, exactly as SyncNet's ``calc_pdist``/``evaluate`` (Chung & Zisserman 2016,
  github.com/joonson/syncnet_python): audio features are zero-padded by ``vshift`` on both
  sides; for every video frame i and window index j ∈ [0, 2·vshift] the Euclidean distance
  ‖v_i − a_{i+j−vshift}‖; the distances are averaged over frames per offset; then
  ``offset = vshift − argmin``, ``LSE-D = min`` and ``confidence (LSE-C) = median − min``.
  A positive offset k means the video lags the audio by k frames (v_i matches a_{i−k}).
  ``pad="valid"`` (an explicit option, not SyncNet's default) averages only over frames whose
  partner exists, removing the zero-padding bias on short clips.
* static drift — autoregressive rollouts longer than the training context tend to freeze. Per-
  frame motion energy m_t = mean|x_{t+1} − x_t| is averaged over windows; a rollout is flagged
  static from the first window whose motion falls below ``ratio`` × the motion inside the first
  ``context`` frames (the regime the model was trained on), or below ``abs_floor``.
* FVD — Fréchet distance between Gaussian fits of per-video features:
  ‖μ₁−μ₂‖² + Tr(Σ₁ + Σ₂ − 2(Σ₁Σ₂)^½), with ``scipy.linalg.sqrtm`` and pytorch-fid's ε·I retry
  when the product is singular. Real FVD uses I3D features; :class:`VideoStatsExtractor` is a
  small deterministic extractor for tests and smoke checks (its numbers are not comparable to
  published FVDs).

Shapes: video (T, H, W) or (T, H, W, C); audio features (T, Da) and video features (T, Dv) for
sync (one row per video frame, same space, as SyncNet's two streams); embeddings (T, D) / (D,).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Annotated, Literal, Protocol, Sequence, runtime_checkable

import numpy as np
import scipy.linalg as sla
from pydantic import BaseModel, Field

from closedloop.artifacts import ArrayInput, ArrayRef, ArtifactError, array_output, load_array
from closedloop.tool import Tool, tool

__all__ = [
    "TalkingHeadGenerator", "FaceEmbedder", "SyncFeatureExtractor", "VideoFeatureExtractor",
    "identity_cosine", "IdentityScore", "av_sync", "SyncScore", "motion_energy", "static_drift", "DriftScore",
    "gaussian_fit", "frechet_distance", "fvd", "VideoStatsExtractor", "evaluate_generator", "GeneratorReport",
    "TOOLS",
]

# ------------------------------------------------------------------------------ interfaces


@runtime_checkable
class TalkingHeadGenerator(Protocol):
    """A generator under evaluation: audio features (T, Da) + identity -> video (T, H, W[, C])."""

    def generate(self, audio: np.ndarray, identity: np.ndarray, num_frames: int, seed: int = 0) -> np.ndarray: ...


@runtime_checkable
class FaceEmbedder(Protocol):
    """Per-frame identity embeddings (ArcFace in the paper): video (T, ...) -> (T, D)."""

    def __call__(self, video: np.ndarray) -> np.ndarray: ...


@runtime_checkable
class SyncFeatureExtractor(Protocol):
    """SyncNet-style two streams in one space: (video, audio) -> (video feats (T, D), audio feats (T, D))."""

    def __call__(self, video: np.ndarray, audio: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


@runtime_checkable
class VideoFeatureExtractor(Protocol):
    """One feature vector per video (I3D for real FVD): videos (N, T, ...) -> (N, D)."""

    def __call__(self, videos: np.ndarray) -> np.ndarray: ...


def _finite(a: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(a, dtype=float)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return a


# ------------------------------------------------------------------------------ identity


class IdentityScore(BaseModel):
    mean: float
    min: float
    worst_frame: int
    per_frame: list[float] | ArrayRef


def identity_cosine(frame_embeddings: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """cos(e_t, e_ref) for each frame; embeddings (T, D) or (D,), reference (D,)."""
    e = _finite(frame_embeddings, "frame_embeddings")
    r = _finite(reference, "reference").reshape(-1)
    e = e[None] if e.ndim == 1 else e
    if e.ndim != 2 or e.shape[1] != r.shape[0]:
        raise ValueError(f"frame embeddings must be (T, {r.shape[0]}) to match the reference, got {list(e.shape)}")
    ne, nr = np.linalg.norm(e, axis=1), np.linalg.norm(r)
    if nr == 0 or np.any(ne == 0):
        raise ValueError("zero-norm embedding: cosine similarity is undefined")
    return (e @ r) / (ne * nr)


# ------------------------------------------------------------------------------ sync


class SyncScore(BaseModel):
    offset: int  # frames; positive: the video lags the audio
    confidence: float  # LSE-C = median - min of the per-offset mean distance
    min_distance: float  # LSE-D
    offsets: list[int]
    mean_distance: list[float]  # per offset, SyncNet's mdist


def av_sync(video_features: np.ndarray, audio_features: np.ndarray, vshift: int = 15,
            pad: Literal["zero", "valid"] = "zero") -> SyncScore:
    """SyncNet offset/confidence from per-frame video and audio features in one embedding space."""
    v, a = _finite(video_features, "video_features"), _finite(audio_features, "audio_features")
    v, a = (v[:, None] if v.ndim == 1 else v), (a[:, None] if a.ndim == 1 else a)
    if v.ndim != 2 or a.ndim != 2 or v.shape != a.shape:
        raise ValueError(f"video and audio features must both be (T, D) with equal shapes, got {list(v.shape)} and {list(a.shape)}")
    if vshift < 0:
        raise ValueError("vshift must be >= 0")
    t = len(v)
    if t < 1:
        raise ValueError("need at least one frame")
    win = 2 * vshift + 1
    ap = np.pad(a, ((vshift, vshift), (0, 0)))
    idx = np.arange(t)[:, None] + np.arange(win)[None, :]  # padded audio index for (frame i, window j)
    # one pass per window position keeps memory at O(T D) rather than O(T win D)
    dists = np.stack([np.linalg.norm(v - ap[j:j + t], axis=1) for j in range(win)], axis=1)  # (T, win)
    if pad == "zero":
        mdist = dists.mean(axis=0)
    else:
        real = (idx >= vshift) & (idx < vshift + t)
        counts = real.sum(axis=0)
        if np.any(counts == 0):
            raise ValueError(f"pad='valid' needs vshift < T ({vshift} >= {t})")
        mdist = np.where(real, dists, 0.0).sum(axis=0) / counts
    j = int(np.argmin(mdist))
    minval = float(mdist[j])
    return SyncScore(offset=vshift - j, confidence=float(np.median(mdist)) - minval, min_distance=minval,
                     offsets=list(range(vshift, -vshift - 1, -1)), mean_distance=mdist.tolist())


# ------------------------------------------------------------------------------ static drift


class DriftScore(BaseModel):
    static: bool
    static_from_frame: int | None  # first frame of the first static window
    reference_motion: float  # mean motion inside the first `context` frames
    window_motion: list[float]  # mean motion per window after the context
    final_to_reference: float  # last window's motion / reference motion


def motion_energy(video: np.ndarray) -> np.ndarray:
    """m_t = mean |x_{t+1} - x_t| over pixels (and channels): (T,) video -> (T-1,)."""
    x = _finite(video, "video")
    if x.ndim not in (3, 4):
        raise ValueError(f"video must be (T, H, W) or (T, H, W, C), got {list(x.shape)}")
    if len(x) < 2:
        raise ValueError("need at least two frames")
    return np.abs(np.diff(x, axis=0)).reshape(len(x) - 1, -1).mean(axis=1)


def static_drift(video: np.ndarray, context: int = 16, window: int = 8, ratio: float = 0.1,
                 abs_floor: float = 1e-6) -> DriftScore:
    """Flag a rollout whose motion collapses after the training context (see the module docstring)."""
    m = motion_energy(video)
    if context < 2 or window < 1:
        raise ValueError("context must be >= 2 and window >= 1")
    if len(m) < context + window:
        raise ValueError(f"a rollout of {len(m) + 1} frames is too short for context={context} and one window of {window}")
    ref = float(m[: context - 1].mean())  # transitions inside the context frames
    tail = m[context:]  # window w: transitions out of frames context + w*window ... + window - 1
    n = len(tail) // window
    wm = tail[: n * window].reshape(n, window).mean(axis=1)
    flagged = (wm < ratio * ref) | (wm < abs_floor)
    first = int(np.argmax(flagged)) if flagged.any() else None
    return DriftScore(static=bool(flagged.any()), static_from_frame=None if first is None else context + first * window,
                      reference_motion=ref, window_motion=wm.tolist(),
                      final_to_reference=float(wm[-1] / ref) if ref > 0 else float("inf") if wm[-1] > 0 else 0.0)


# ------------------------------------------------------------------------------ FVD


def gaussian_fit(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (unbiased, as numpy's cov) covariance of (N, D) features."""
    f = _finite(features, "features")
    if f.ndim != 2 or len(f) < 2:
        raise ValueError(f"features must be (N, D) with N >= 2, got {list(f.shape)}")
    return f.mean(axis=0), np.atleast_2d(np.cov(f, rowvar=False))


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray,
                     eps: float = 1e-6) -> float:
    """‖μ₁−μ₂‖² + Tr(Σ₁ + Σ₂ − 2(Σ₁Σ₂)^½) (pytorch-fid's formula and singular-product fallback)."""
    mu1, mu2 = np.atleast_1d(mu1), np.atleast_1d(mu2)
    sigma1, sigma2 = np.atleast_2d(sigma1), np.atleast_2d(sigma2)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (len(mu1), len(mu1)):
        raise ValueError("means and covariances of the two sets must have matching dimensions")
    diff = mu1 - mu2
    with warnings.catch_warnings():  # pytorch-fid calls sqrtm(disp=False): a singular product is not an error
        warnings.simplefilter("ignore", sla.LinAlgWarning)
        covmean = sla.sqrtm(sigma1 @ sigma2)
        if not np.all(np.isfinite(covmean)):
            offset = np.eye(len(mu1)) * eps
            covmean = sla.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"imaginary component {np.max(np.abs(covmean.imag)):.3g} in the matrix square root")
        covmean = covmean.real
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


@dataclass
class VideoStatsExtractor:
    """A deterministic, weight-free stand-in for I3D: per-video appearance and motion statistics
    (mean/std intensity, mean/std of frame-difference energy, mean spatial gradient, and the
    motion energy at ``bins`` evenly spaced points). For tests and smoke checks only."""

    bins: int = 4

    def __call__(self, videos: np.ndarray) -> np.ndarray:
        v = _finite(videos, "videos")
        if v.ndim not in (4, 5):
            raise ValueError(f"videos must be (N, T, H, W) or (N, T, H, W, C), got {list(v.shape)}")
        out = []
        for x in v:
            m = motion_energy(x)
            grad = np.abs(np.diff(x, axis=1)).mean() + np.abs(np.diff(x, axis=2)).mean()
            pts = np.interp(np.linspace(0, len(m) - 1, self.bins), np.arange(len(m)), m)
            out.append(np.concatenate([[x.mean(), x.std(), m.mean(), m.std(), grad], pts]))
        return np.asarray(out)


def fvd(real: np.ndarray, generated: np.ndarray, extractor: VideoFeatureExtractor | None = None) -> float:
    """Fréchet distance between Gaussian fits of extractor features of two video sets (N, T, ...)."""
    ex = extractor or VideoStatsExtractor()
    fr, fg = np.asarray(ex(real), dtype=float), np.asarray(ex(generated), dtype=float)
    if fr.ndim != 2 or fg.ndim != 2 or fr.shape[1] != fg.shape[1]:
        raise ValueError(f"the extractor must return (N, D) for both sets, got {list(fr.shape)} and {list(fg.shape)}")
    return frechet_distance(*gaussian_fit(fr), *gaussian_fit(fg))


# ------------------------------------------------------------------------------ harness


class GeneratorReport(BaseModel):
    n_clips: int
    identity_mean: float | None
    identity_min: float | None
    sync_offsets: list[int] | None
    sync_confidence_mean: float | None
    lse_d_mean: float | None
    static_clips: int
    fvd: float | None


def evaluate_generator(generator: TalkingHeadGenerator, audios: Sequence[np.ndarray], identities: Sequence[np.ndarray],
                       num_frames: int, *, face_embedder: FaceEmbedder | None = None,
                       sync_extractor: SyncFeatureExtractor | None = None, real_videos: np.ndarray | None = None,
                       video_extractor: VideoFeatureExtractor | None = None, vshift: int = 15, context: int = 16,
                       window: int = 8, ratio: float = 0.1, seed: int = 0) -> GeneratorReport:
    """Generate one clip per (audio, identity) and score it on every metric whose network is given."""
    if not isinstance(generator, TalkingHeadGenerator):
        raise TypeError("generator must have generate(audio, identity, num_frames, seed)")
    if len(audios) != len(identities) or not audios:
        raise ValueError("need as many identities as audio clips, at least one")
    clips = [np.asarray(generator.generate(a, i, num_frames, seed + k), dtype=float)
             for k, (a, i) in enumerate(zip(audios, identities))]
    for c in clips:
        if len(c) != num_frames:
            raise ValueError(f"generator returned {len(c)} frames, asked for {num_frames}")
    ids = [identity_cosine(face_embedder(c), i) for c, i in zip(clips, identities)] if face_embedder else None
    syncs = [av_sync(*sync_extractor(c, a), vshift=vshift) for c, a in zip(clips, audios)] if sync_extractor else None
    static = sum(static_drift(c, context, window, ratio).static for c in clips)
    dist = fvd(real_videos, np.stack(clips), video_extractor) if real_videos is not None else None
    return GeneratorReport(
        n_clips=len(clips), identity_mean=float(np.mean([s.mean() for s in ids])) if ids else None,
        identity_min=float(min(s.min() for s in ids)) if ids else None,
        sync_offsets=[s.offset for s in syncs] if syncs else None,
        sync_confidence_mean=float(np.mean([s.confidence for s in syncs])) if syncs else None,
        lse_d_mean=float(np.mean([s.min_distance for s in syncs])) if syncs else None, static_clips=int(static), fvd=dist)


# ------------------------------------------------------------------------------ tools

PosInt = Annotated[int, Field(ge=1)]


@tool
def identity_similarity(frame_embeddings: ArrayInput, reference_embedding: ArrayInput) -> IdentityScore:
    """Identity preservation: cosine of each frame's face embedding (e.g. ArcFace) with the reference identity embedding.

    Args:
        frame_embeddings: (T, D) per-frame embeddings: .npy/.npz/.safetensors path or inline list.
        reference_embedding: (D,) reference identity embedding.
    """
    cos = identity_cosine(load_array(frame_embeddings, name="frame_embeddings"),
                          load_array(reference_embedding, name="reference_embedding"))
    return IdentityScore(mean=float(cos.mean()), min=float(cos.min()), worst_frame=int(np.argmin(cos)),
                         per_frame=array_output(cos, prefix="identity-cos"))


@tool
def av_sync_offset(video_features: ArrayInput, audio_features: ArrayInput, vshift: Annotated[int, Field(ge=0, le=100)] = 15,
                   pad: Literal["zero", "valid"] = "zero") -> SyncScore:
    """Audio-visual sync as SyncNet computes it: the offset minimising the mean feature distance, LSE-D (that
    minimum) and LSE-C confidence (median minus minimum). Positive offset: the video lags the audio.

    Args:
        video_features: (T, D) per-frame visual (mouth) features, or (T,) e.g. a mouth-opening signal.
        audio_features: (T, D) per-frame audio features in the same space, or (T,) e.g. an audio envelope.
        vshift: Largest offset searched, in frames (SyncNet: 15).
        pad: 'zero' (SyncNet's zero padding) or 'valid' (average only over frames with a partner).
    """
    return av_sync(load_array(video_features, name="video_features"), load_array(audio_features, name="audio_features"),
                   vshift=vshift, pad=pad)


@tool
def static_drift_check(video: ArrayInput, context: Annotated[int, Field(ge=2)] = 16, window: PosInt = 8,
                       ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1) -> DriftScore:
    """Detect an autoregressive rollout collapsing to static motion after its training context.

    Args:
        video: (T, H, W) or (T, H, W, C) rollout: .npy/.npz/.safetensors path.
        context: Frames of the training context; their motion is the reference.
        window: Frames per window after the context.
        ratio: A window is static when its motion is below ratio times the reference.
    """
    return static_drift(load_array(video, name="video"), context=context, window=window, ratio=ratio)


class FVDReport(BaseModel):
    fvd: float
    n_real: int
    n_generated: int
    feature_dim: int
    extractor: str


@tool(timeout_s=300)
def frechet_video_distance(real: ArrayInput, generated: ArrayInput,
                           inputs: Literal["features", "videos"] = "features") -> FVDReport:
    """Fréchet distance between Gaussian fits of two sets: precomputed per-video features (e.g. I3D) or raw videos
    through the built-in statistics extractor (a smoke-test stand-in, not comparable to published FVD).

    Args:
        real: (N, D) features or (N, T, H, W[, C]) videos: .npy/.npz/.safetensors path.
        generated: like real.
        inputs: 'features' or 'videos'.
    """
    r, g = load_array(real, name="real"), load_array(generated, name="generated")
    if inputs == "videos":
        ex = VideoStatsExtractor()
        r, g, name = ex(r), ex(g), "VideoStatsExtractor"
    else:
        name = "precomputed"
    if r.ndim != 2 or g.ndim != 2 or r.shape[1] != g.shape[1]:
        raise ArtifactError(f"features must be (N, D) with equal D, got {list(r.shape)} and {list(g.shape)}")
    return FVDReport(fvd=frechet_distance(*gaussian_fit(r), *gaussian_fit(g)), n_real=len(r), n_generated=len(g),
                     feature_dim=int(r.shape[1]), extractor=name)


TOOLS: list[Tool] = [identity_similarity, av_sync_offset, static_drift_check, frechet_video_distance]
