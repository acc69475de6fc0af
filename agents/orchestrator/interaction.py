"""The interaction layer (paper 4): streamed text and speech, and barge-in.

A :class:`Session` holds one conversation with the orchestrator graph. ``ask`` runs a turn and
starts saying the answer: text deltas and speech chunks go to the caller's sinks while a
:class:`Player` plays the audio in real time (one chunk of ``chunk_ms`` at a time). User input
that arrives while the system is speaking (:meth:`Session.barge_in`) cancels playback at the next
chunk boundary and yields the turn: the bound on the cancel latency is one chunk by construction
(``chunk_ms``, 20 ms by default), and every cancel's measured latency is kept
(``Session.barge_in_latencies_s``; ``benchmarks/bench_orchestrator.py`` reports p50/p95).

TTS engines: ``tone`` (offline, deterministic: a short tone per character, real 16-bit PCM, for
tests and machines without a speech engine) and ``espeak-ng`` (the ``espeak-ng`` program, when
installed, through ``--stdout``).
"""

from __future__ import annotations

import asyncio
import io
import math
import shutil
import struct
import subprocess
import time
import wave
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from closedloop.agents.orchestrator.experts import TTSSpec
from closedloop.messages import UserMessage

__all__ = ["ToneTTS", "EspeakTTS", "make_tts", "Player", "Session"]


class ToneTTS:
    """A stand-in voice: 60 ms of a tone per character (pitch by character), 16 kHz mono int16."""

    def __init__(self, rate: int = 16_000) -> None:
        self.rate = rate

    def synthesize(self, text: str) -> bytes:
        samples: list[int] = []
        per_char = int(0.06 * self.rate)
        for ch in text:
            freq = 200 + (ord(ch) % 40) * 10
            amp = 0 if ch.isspace() else 8000
            samples.extend(int(amp * math.sin(2 * math.pi * freq * i / self.rate)) for i in range(per_char))
        return struct.pack(f"<{len(samples)}h", *samples)


class EspeakTTS:
    """espeak-ng through its command line (raw PCM extracted from the WAV it writes to stdout)."""

    def __init__(self, voice: str | None = None) -> None:
        exe = shutil.which("espeak-ng")
        if exe is None:
            raise RuntimeError("espeak-ng is not installed (apt install espeak-ng), use tts.engine: tone")
        self.exe: str = exe
        self.voice = voice
        self.rate = 22_050

    def synthesize(self, text: str) -> bytes:
        cmd = [self.exe, "--stdout"] + (["-v", self.voice] if self.voice else []) + [text]
        wav = subprocess.run(cmd, capture_output=True, check=True, timeout=60).stdout
        with wave.open(io.BytesIO(wav)) as w:
            self.rate = w.getframerate()
            return w.readframes(w.getnframes())


def make_tts(spec: TTSSpec) -> Any:
    return EspeakTTS(spec.voice) if spec.engine == "espeak-ng" else ToneTTS(spec.rate)


def chunks(pcm: bytes, rate: int, chunk_ms: int) -> Iterator[bytes]:
    size = max(2, int(rate * chunk_ms / 1000) * 2)
    for i in range(0, len(pcm), size):
        yield pcm[i:i + size]


@dataclass
class Player:
    """Plays PCM chunks in real time; cancellable between chunks."""

    chunk_ms: int = 20
    sink: Callable[[bytes], None] | None = None
    played: int = 0
    stopped_at: float | None = None
    _task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def speaking(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, pcm: bytes, rate: int) -> asyncio.Task:
        async def play() -> None:
            try:
                for c in chunks(pcm, rate, self.chunk_ms):
                    if self.sink is not None:
                        self.sink(c)
                    self.played += 1
                    await asyncio.sleep(self.chunk_ms / 1000)
            finally:
                self.stopped_at = time.perf_counter()

        self.played, self.stopped_at = 0, None
        self._task = asyncio.ensure_future(play())
        return self._task

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


@dataclass
class Session:
    """One conversation: turns through the orchestrator graph, answers spoken, barge-in honoured.

    ``context`` is the graph's run context (the controller, the experts and the memory), the same
    for every turn, so the memory lives as long as the session."""

    graph: Any
    context: Any = None
    tts: Any = field(default_factory=ToneTTS)
    player: Player = field(default_factory=Player)
    on_text: Callable[[str], None] | None = None
    thread_id: str = "session"
    barge_in_latencies_s: list[float] = field(default_factory=list)
    interrupted: int = 0
    history: list[Any] = field(default_factory=list)

    async def ask(self, content: Any) -> dict[str, Any]:
        """Run one user turn; start speaking the answer; return the graph's final state."""
        if self.player.speaking:
            await self.barge_in()
        message = content if isinstance(content, UserMessage) else UserMessage(content=content)
        state = await self.graph.ainvoke({"messages": self.history + [message], "scratch": {}}, context=self.context)
        self.history = list(state["messages"])
        final = (state.get("scratch") or {}).get("final") or {}
        if final.get("kind") == "speak":
            text = final["text"]
            if self.on_text is not None:
                for word in text.split(" "):
                    self.on_text(word + " ")
            pcm = await asyncio.to_thread(self.tts.synthesize, text)
            self.player.start(pcm, self.tts.rate)
        elif final.get("kind") == "interrupt":
            await self.barge_in()
        return state

    async def barge_in(self) -> float | None:
        """The user started talking: stop speaking now; returns the cancel latency (s) if speaking."""
        if not self.player.speaking:
            return None
        t0 = time.perf_counter()
        await self.player.stop()
        latency = (self.player.stopped_at or time.perf_counter()) - t0
        self.barge_in_latencies_s.append(latency)
        self.interrupted += 1
        return latency
