"""STARCaster evaluation contract on synthetic clips whose answers are known by construction."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from closedloop.tool import ToolRegistry
from closedloop.tools.starcaster import (
    TOOLS,
    TalkingHeadGenerator,
    VideoStatsExtractor,
    av_sync,
    evaluate_generator,
    frechet_distance,
    fvd,
    gaussian_fit,
    identity_cosine,
    static_drift,
)

H = W = 16


def envelope(t: int, seed: int) -> np.ndarray:
    """A smooth positive audio envelope (syllable-like bumps)."""
    x = np.random.default_rng(seed).standard_normal(t + 8)
    return np.convolve(np.abs(x), np.ones(4) / 4, mode="same")[4:-4]


def render(opening: np.ndarray, identity: np.ndarray) -> np.ndarray:
    """A face: an identity-coloured background and a dark mouth whose height follows ``opening``."""
    frames = np.tile((0.5 + 0.1 * identity[:3])[None, None, None, :], (len(opening), H, W, 1))
    for t, o in enumerate(opening):
        rows = int(round(np.clip(o, 0, 1) * 6))
        frames[t, 9:9 + rows, 5:11, :] = 0.0
    return frames


def mouth_opening(video: np.ndarray) -> np.ndarray:
    return (video[:, 9:15, 5:11, :] < 0.25).mean(axis=(1, 2, 3)) * 6


def zscore(x: np.ndarray) -> np.ndarray:
    return ((x - x.mean()) / (x.std() + 1e-12))[:, None]


def sync_extractor(video: np.ndarray, audio: np.ndarray):
    return zscore(mouth_opening(video)), zscore(audio)


class DelayedMouth:
    """A generator whose mouth follows the audio `delay` frames late; `freeze_at` freezes the rollout."""

    def __init__(self, delay: int = 0, freeze_at: int | None = None) -> None:
        self.delay, self.freeze_at = delay, freeze_at

    def generate(self, audio, identity, num_frames, seed=0):
        opening = np.roll(audio, self.delay)[:num_frames] / audio.max()
        video = render(opening, identity)
        video += 0.01 * np.random.default_rng(seed).standard_normal(video.shape)  # sensor noise
        if self.freeze_at is not None:
            video[self.freeze_at:] = video[self.freeze_at]
        return video


def syncnet_mdist(vid: torch.Tensor, aud: torch.Tensor, vshift: int) -> torch.Tensor:
    """SyncNet's calc_pdist + mean over frames, written as its reference loop."""
    win = vshift * 2 + 1
    aud_p = F.pad(aud, (0, 0, vshift, vshift))
    dists = [F.pairwise_distance(vid[[i], :].repeat(win, 1), aud_p[i:i + win, :], eps=0.0) for i in range(len(vid))]
    return torch.mean(torch.stack(dists, 1), 1)


@pytest.mark.parametrize("k", [-6, -1, 0, 3, 7])
@pytest.mark.parametrize("pad", ["zero", "valid"])
def test_mouth_shifted_by_k_frames_gives_offset_k(k, pad):
    env = envelope(200, seed=k + 10)
    mouth = np.roll(env, k)  # the mouth opens k frames after the sound: the video lags by k
    res = av_sync(zscore(mouth), zscore(env), vshift=10, pad=pad)
    assert res.offset == k
    assert res.confidence > 0.3 and res.min_distance < 0.2
    assert res.offsets[int(np.argmin(res.mean_distance))] == k


def test_distances_match_syncnet_reference_loop():
    rng = np.random.default_rng(0)
    v, a = rng.standard_normal((40, 8)), rng.standard_normal((40, 8))
    res = av_sync(v, a, vshift=6)
    ref = syncnet_mdist(torch.tensor(v), torch.tensor(a), 6).numpy()
    assert np.allclose(res.mean_distance, ref, atol=1e-10)
    j = int(np.argmin(ref))
    assert res.offset == 6 - j and np.isclose(res.confidence, np.median(ref) - ref[j])


def test_unrelated_streams_are_less_confident_than_synced_ones():
    env = envelope(200, 1)
    synced = av_sync(zscore(env), zscore(env), vshift=10)
    unrelated = av_sync(zscore(envelope(200, 2)), zscore(env), vshift=10)
    assert synced.confidence > 3 * unrelated.confidence
    assert synced.min_distance < unrelated.min_distance


def test_identity_cosine_is_scale_invariant_and_bounded():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(16)
    e = np.stack([ref, 3 * ref, -ref, np.r_[ref[8:], ref[:8]]])
    cos = identity_cosine(e, ref)
    assert np.allclose(cos[:3], [1, 1, -1]) and -1 <= cos[3] <= 1
    ortho = np.eye(16)
    assert np.allclose(identity_cosine(ortho[1:3], ortho[0]), 0)
    with pytest.raises(ValueError, match="zero-norm"):
        identity_cosine(np.zeros((2, 16)), ref)
    with pytest.raises(ValueError, match="match the reference"):
        identity_cosine(np.ones((2, 15)), ref)


def test_frozen_rollout_is_flagged_static_from_the_freeze():
    env, ident = envelope(96, 3), np.ones(3)
    moving = DelayedMouth().generate(env, ident, 96)
    frozen = DelayedMouth(freeze_at=50).generate(env, ident, 96)
    assert not static_drift(moving, context=16, window=8).static
    drift = static_drift(frozen, context=16, window=8)
    assert drift.static and drift.static_from_frame == 56  # [48, 56) still moves (2 of 8 steps); [56, 64) is frozen
    assert drift.window_motion[-1] == 0.0 and drift.final_to_reference == 0.0
    with pytest.raises(ValueError, match="too short"):
        static_drift(moving[:20], context=16, window=8)


def test_frechet_distance_closed_forms():
    rng = np.random.default_rng(0)
    f = rng.standard_normal((500, 6))
    assert abs(frechet_distance(*gaussian_fit(f), *gaussian_fit(f))) < 1e-8  # identical sets: 0
    d = np.arange(6.0)
    assert np.isclose(frechet_distance(*gaussian_fit(f), *gaussian_fit(f + d)), d @ d)  # translation: |d|^2
    s1, s2 = np.array([1.0, 4.0, 0.25]), np.array([9.0, 1.0, 1.0])  # diagonal: sum (sqrt s1 - sqrt s2)^2
    mu = np.array([1.0, 0.0, -2.0])
    assert np.isclose(frechet_distance(mu, np.diag(s1), 0 * mu, np.diag(s2)), mu @ mu + np.sum((np.sqrt(s1) - np.sqrt(s2)) ** 2))
    a, b = rng.standard_normal((300, 4)), 2 * rng.standard_normal((300, 4)) + 1
    assert np.isclose(frechet_distance(*gaussian_fit(a), *gaussian_fit(b)), frechet_distance(*gaussian_fit(b), *gaussian_fit(a)))
    # rank-deficient covariances take the eps fallback and stay finite
    low = np.c_[f[:, :1], f[:, :1]]
    assert np.isfinite(frechet_distance(*gaussian_fit(low), *gaussian_fit(low + 1)))


def test_identical_video_sets_give_fvd_zero():
    ident = np.ones(3)
    vids = np.stack([DelayedMouth().generate(envelope(40, s), ident, 40, seed=s) for s in range(6)])
    assert abs(fvd(vids, vids)) < 1e-8
    assert VideoStatsExtractor(bins=2)(vids).shape == (6, 7)  # 5 statistics + 2 motion samples per video
    assert abs(fvd(vids, vids, VideoStatsExtractor(bins=2))) < 1e-8
    assert fvd(vids, vids[:, :, ::-1]) < fvd(vids, np.clip(vids + 0.3, 0, 1))  # a mirror keeps the stats


def test_generator_harness_recovers_delay_and_flags_freezing():
    t, ident = 96, [np.array([1.0, 0.0, -1.0]), np.array([0.0, 1.0, 1.0])]
    audios = [envelope(t, 20), envelope(t, 21)]
    face = lambda v: (v[:, :8].mean(axis=(1, 2)) - 0.5) / 0.1  # noqa: E731  (the background colour is the identity)
    assert isinstance(DelayedMouth(), TalkingHeadGenerator)
    real = np.stack([DelayedMouth().generate(envelope(t, s), ident[s % 2], t, seed=s) for s in range(8)])
    good = evaluate_generator(DelayedMouth(delay=2), audios, ident, t, face_embedder=face, sync_extractor=sync_extractor,
                              real_videos=real, vshift=8)
    assert good.sync_offsets == [2, 2] and good.static_clips == 0
    assert good.identity_min > 0.99
    bad = evaluate_generator(DelayedMouth(delay=2, freeze_at=40), audios, ident, t, sync_extractor=sync_extractor,
                             real_videos=real, vshift=8)
    assert bad.static_clips == 2 and bad.fvd > good.fvd
    with pytest.raises(TypeError):
        evaluate_generator(object(), audios, ident, t)  # type: ignore[arg-type]


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path / "artifacts"))
    return ToolRegistry().extend(TOOLS)


async def test_tools_score_files_and_report_bad_input(registry, tmp_path):
    env = envelope(120, 5)
    np.save(tmp_path / "v.npy", zscore(np.roll(env, 4)))
    np.save(tmp_path / "a.npy", zscore(env))
    res = await registry.call_json("av_sync_offset", json.dumps({"video_features": str(tmp_path / "v.npy"),
                                                                 "audio_features": str(tmp_path / "a.npy"), "vshift": 8}))
    assert res.ok, res.error
    assert json.loads(res.content)["offset"] == 4
    video = DelayedMouth(freeze_at=40).generate(envelope(80, 6), np.ones(3), 80)
    np.save(tmp_path / "roll.npy", video)
    drift = json.loads((await registry.call_json("static_drift_check", json.dumps({"video": str(tmp_path / "roll.npy")}))).content)
    assert drift["static"] and drift["static_from_frame"] == 40
    rng = np.random.default_rng(0)
    np.save(tmp_path / "f.npy", rng.standard_normal((50, 4)))
    same = json.loads((await registry.call_json("frechet_video_distance", json.dumps(
        {"real": str(tmp_path / "f.npy"), "generated": str(tmp_path / "f.npy")}))).content)
    assert abs(same["fvd"]) < 1e-8 and same["feature_dim"] == 4
    vids = np.stack([DelayedMouth().generate(envelope(40, s), np.ones(3), 40, seed=s) for s in range(4)])
    np.save(tmp_path / "vids.npy", vids)
    raw = json.loads((await registry.call_json("frechet_video_distance", json.dumps(
        {"real": str(tmp_path / "vids.npy"), "generated": str(tmp_path / "vids.npy"), "inputs": "videos"}))).content)
    assert abs(raw["fvd"]) < 1e-8 and raw["extractor"] == "VideoStatsExtractor" and raw["n_real"] == 4
    ids = json.loads((await registry.call_json("identity_similarity", json.dumps(
        {"frame_embeddings": [[1, 0], [1, 1]], "reference_embedding": [2, 0]}))).content)
    assert np.allclose(ids["per_frame"], [1, 2 ** -0.5]) and ids["worst_frame"] == 1
    missing = await registry.call_json("av_sync_offset", json.dumps({"video_features": str(tmp_path / "none.npy"),
                                                                     "audio_features": [1, 2]}))
    assert not missing.ok and "not found" in missing.error
    np.save(tmp_path / "nan.npy", np.full((10, 2), np.nan))
    nan = await registry.call_json("frechet_video_distance", json.dumps({"real": str(tmp_path / "nan.npy"),
                                                                         "generated": str(tmp_path / "f.npy")}))
    assert not nan.ok and "NaN or infinite" in nan.error
    shapes = await registry.call_json("av_sync_offset", json.dumps({"video_features": [[1, 2], [3, 4]],
                                                                    "audio_features": [1, 2, 3]}))
    assert not shapes.ok and "equal shapes" in shapes.error
    dims = await registry.call_json("frechet_video_distance", json.dumps({"real": str(tmp_path / "f.npy"),
                                                                          "generated": [[1.0, 2.0], [3.0, 1.0]]}))
    assert not dims.ok and "equal D" in dims.error
    neg = await registry.call_json("av_sync_offset", json.dumps({"video_features": [1, 2], "audio_features": [1, 2],
                                                                 "vshift": -1}))
    assert not neg.ok and neg.error_kind == "invalid_arguments"
