"""Speech to text for agents: audio out of a file (PyAV), text out of a speech-recognition checkpoint.

One entry point, :class:`SpeechRecognizer`, over any transformers speech-to-text checkpoint
(Whisper and the like: ``AutoProcessor`` + ``AutoModelForSpeechSeq2Seq``), given as ``hf:<dir>``,
loaded once and reused. :func:`load_audio` decodes the audio track of a video or audio file, or
raw bytes, to 16 kHz mono float32 (what speech models take), so FactGuard's missing transcripts
and the orchestrator's ASR expert share one path. :mod:`closedloop.models.tiny_asr` builds a tiny
Whisper offline for tests.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

__all__ = ["SAMPLE_RATE", "load_audio", "SpeechRecognizer", "NoAudioError"]

SAMPLE_RATE = 16_000


class NoAudioError(ValueError):
    """The file has no audio track (a silent video): nothing to transcribe."""


def load_audio(source: str | Path | bytes, rate: int = SAMPLE_RATE) -> Any:
    """The first audio stream, resampled to ``rate`` Hz mono float32 (a numpy array)."""
    import av
    import numpy as np

    handle = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source)
    with av.open(handle, "r") as c:
        if not c.streams.audio:
            raise NoAudioError(f"{'the audio bytes' if isinstance(source, (bytes, bytearray)) else source} "
                               f"has no audio track")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        parts = [r.to_ndarray().reshape(-1) for f in c.decode(audio=0) for r in resampler.resample(f)]
        parts += [r.to_ndarray().reshape(-1) for r in resampler.resample(None)]
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, dtype=np.float32)


class SpeechRecognizer:
    """``hf:<dir>`` of a speech-to-text checkpoint (Whisper-style encoder-decoder); thread-safe,
    loaded once. Whisper checkpoints are told the task (transcribe; English when the checkpoint
    knows languages) rather than left to guess it."""

    def __init__(self, spec: str, *, max_new_tokens: int = 128) -> None:
        if not spec.startswith("hf:"):
            raise ValueError(f"speech recognition needs an hf:<checkpoint dir> spec, got {spec!r}")
        self.spec = spec
        self.path = spec[3:]
        if not (Path(self.path) / "config.json").is_file():
            raise FileNotFoundError(f"speech model not found: {self.path}")
        self.max_new_tokens = max_new_tokens
        self._model: Any = None
        self._processor: Any = None
        self._lock = threading.Lock()
        self.calls = 0

    def _load(self) -> None:
        if self._model is None:
            from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.path)
            self._model = AutoModelForSpeechSeq2Seq.from_pretrained(self.path).eval()

    def transcribe(self, source: str | Path | bytes | Any) -> str:
        """Text of an audio/video file, audio bytes, or a 16 kHz float32 array."""
        import torch

        audio = source if hasattr(source, "dtype") else load_audio(source)
        with self._lock:
            self._load()
            self.calls += 1
            feats = self._processor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt")
            room = getattr(self._model.config, "max_target_positions", None)
            limit = self.max_new_tokens if room is None else max(1, min(self.max_new_tokens, room - 8))
            kwargs: dict[str, Any] = {"max_new_tokens": limit}
            gen = self._model.generation_config
            if getattr(gen, "task_to_id", None):
                kwargs["task"] = "transcribe"
            if getattr(gen, "lang_to_id", None) and "<|en|>" in gen.lang_to_id:
                kwargs["language"] = "en"
            with torch.no_grad():
                out = self._model.generate(feats["input_features"], **kwargs)
            return self._processor.batch_decode(out, skip_special_tokens=True)[0].strip()
