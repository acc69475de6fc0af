"""The speech path: audio out of a video file (PyAV), text out of a Whisper-architecture checkpoint,
used by FactGuard for missing transcripts and by the orchestrator's ASR expert."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from PIL import Image

from closedloop.models.asr import NoAudioError, SpeechRecognizer, load_audio
from closedloop.tools.clipscout import write_video


def tone(seconds: float, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(16_000 * seconds)) / 16_000
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_audio_track_of_a_video_round_trips(tmp_path):
    frames = [Image.new("RGB", (32, 32), (i * 10, 0, 0)) for i in range(16)]
    path = write_video(tmp_path / "v.mp4", frames, fps=8, audio=tone(2.0))
    audio = load_audio(path)
    assert audio.dtype == np.float32 and abs(len(audio) - 32_000) < 2_048  # AAC pads to whole frames
    spectrum = np.abs(np.fft.rfft(audio[4000:20000]))
    assert abs(np.argmax(spectrum) * 16_000 / 16_000 - 440) < 5  # the tone's frequency survived the codec
    silent = write_video(tmp_path / "silent.mp4", frames, fps=8)
    with pytest.raises(NoAudioError, match="no audio track"):
        load_audio(silent)


def test_tiny_whisper_transcribes_through_the_real_stack(tiny_asr_path, tmp_path):
    frames = [Image.new("RGB", (32, 32), (0, 0, 0))] * 8
    video = write_video(tmp_path / "v.mp4", frames, fps=8, audio=tone(1.0))
    rec = SpeechRecognizer(f"hf:{tiny_asr_path}")
    assert rec.transcribe(video).startswith("hello world")
    assert rec.transcribe(tone(0.5, 200.0)).startswith("hello world") and rec.calls == 2
    with pytest.raises(ValueError, match="hf:<checkpoint dir>"):
        SpeechRecognizer("openai:whisper-1")


def test_factguard_fills_missing_transcripts_with_the_asr_expert(tiny_asr_path, tmp_path):
    from closedloop.evals.factguard.env import FactGuardEnv
    from closedloop.evals.factguard.synthetic import make_synthetic

    samples = make_synthetic(tmp_path / "d", n=4, frames=8, audio=True, missing_transcripts=1.0)
    assert all(s.transcript is None for s in samples)
    env = FactGuardEnv(data_dir=str(tmp_path / "d"), split="all", asr=f"hf:{tiny_asr_path}")
    msgs, _ = asyncio.run(env.areset(0))
    assert "Speech transcript: hello world" in msgs[-1].text
    plain = FactGuardEnv(data_dir=str(tmp_path / "d"), split="all")
    assert "Speech transcript: (no speech)" in asyncio.run(plain.areset(0))[0][-1].text


def test_orchestrator_asr_expert_reads_an_audio_part(tiny_asr_path, tmp_path):
    from closedloop.agents.orchestrator.experts import ExpertPool, OrchestratorConfig
    from closedloop.messages import AudioPart

    frames = [Image.new("RGB", (32, 32))] * 8
    clip = write_video(tmp_path / "a.mp4", frames, fps=8, audio=tone(1.0)).read_bytes()
    pool = ExpertPool(OrchestratorConfig.model_validate(
        {"experts": {"asr": {"kind": "asr", "model": f"hf:{tiny_asr_path}", "modality": "audio"}}}))
    part = AudioPart(input_audio={"data": base64.b64encode(clip).decode(), "format": "mp4"})
    assert asyncio.run(pool.run("asr", "transcribe", part)).startswith("hello world")
    assert pool.calls["asr"] == 1
