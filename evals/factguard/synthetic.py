"""A small synthetic FactGuard dataset: short videos with on-screen claims, transcripts, metadata,
labels, publish times, and an evidence corpus that settles some claims and not others.

Why it is shaped this way: it must exercise every part of the agent loop offline, and let a
small policy learn something where the reward's coefficients matter.

* Each sample claims an event ("a shark swims on the highway in Houston"), shown as on-screen
  text in the video and spoken in the transcript; the metadata (title, uploader, date) is neutral.
* The corpus settles a fraction ``evidence_rate`` of the claims: a fact check ("FALSE: ...") for a
  fake one, a news report ("CONFIRMED: ...") for a real one. The rest are ambiguous: searching
  finds nothing decisive, so the agent must decide under uncertainty; that is where the risk
  weights α (false positive) and γ (false negative) move a trained policy's precision and recall.
* A fake video also carries a visual tell in one span (a frame stamped "EDIT"), which ClipScout can
  find when the model reads images.

``audio`` adds a sound track (a tone), and ``missing_transcripts`` leaves that fraction of
transcripts out, for the ASR expert. Writes ``samples.jsonl`` (:class:`~closedloop.evals.factguard.data.Sample` rows, videos
relative), ``videos/*.mp4``, ``corpus.jsonl`` and the BM25 index ``corpus.duckdb``.
"""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

from closedloop.evals.factguard.data import Sample

SUBJECTS = ["a shark", "a tiger", "a whale", "a crocodile", "an eagle", "a bear", "a kangaroo", "a penguin"]
ACTIONS = ["swims on the highway", "walks into a supermarket", "lands on the bridge", "appears in the subway",
           "blocks the airport runway", "crosses the main square"]
PLACES = ["Houston", "Lisbon", "Osaka", "Nairobi", "Toronto", "Sydney", "Lyon", "Lima", "Oslo", "Seoul", "Dublin",
          "Quito", "Hanoi", "Dakar", "Perth", "Porto", "Kyoto", "Accra", "Tunis", "Riga"]
MAX_SAMPLES = len(SUBJECTS) * len(ACTIONS) * len(PLACES)  # every claim is distinct
UPLOADERS = ["newsfan22", "citywatch", "dailyclips", "localeye", "viralnow"]


def _claim(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} in {rng.choice(PLACES)}"


def _frames(claim: str, fake: bool, rng: random.Random, n: int, size: tuple[int, int]) -> list:
    from PIL import Image, ImageDraw

    base = tuple(rng.randrange(40, 200) for _ in range(3))
    tell = rng.randrange(n // 4, n - n // 4) if fake else -1
    frames = []
    for i in range(n):
        img = Image.new("RGB", size, tuple(min(255, c + i) for c in base))
        d = ImageDraw.Draw(img)
        d.text((4, 4), claim[:40], fill=(255, 255, 255))
        d.text((4, 18), claim[40:80], fill=(255, 255, 255))
        if abs(i - tell) <= 1:
            d.rectangle([size[0] - 40, size[1] - 20, size[0] - 2, size[1] - 2], fill=(255, 0, 0))
            d.text((size[0] - 36, size[1] - 18), "EDIT", fill=(255, 255, 255))
        frames.append(img)
    return frames


def make_synthetic(out_dir: str | Path, n: int = 40, *, seed: int = 0, evidence_rate: float = 0.6,
                   fake_rate: float = 0.5, frames: int = 24, fps: int = 8, size: tuple[int, int] = (96, 64),
                   videos: bool = True, audio: bool = False, missing_transcripts: float = 0.0) -> list[Sample]:
    """Write the dataset into ``out_dir`` and return its samples (in publish order)."""
    from closedloop.tools.clipscout import write_video
    from closedloop.tools.factprobe import LocalCorpus

    if not 2 <= n <= MAX_SAMPLES:
        raise ValueError(f"n must be in 2..{MAX_SAMPLES} (claims are distinct)")
    rng = random.Random(seed)
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    start = datetime(2024, 1, 1, tzinfo=timezone.utc)
    samples, docs, seen = [], [], set()
    for i in range(n):
        claim = _claim(rng)
        while claim in seen:
            claim = _claim(rng)
        seen.add(claim)
        fake = rng.random() < fake_rate
        sid = f"syn{i:04d}"
        when = start + timedelta(days=i, hours=rng.randrange(24))
        video = None
        if videos:
            sound = None
            if audio:  # a tone standing in for speech (the ASR expert's input)
                import numpy as np

                t = np.arange(int(16_000 * frames / fps)) / 16_000
                sound = (0.3 * np.sin(2 * np.pi * rng.choice([220, 330, 440]) * t)).astype(np.float32)
            write_video(out / "videos" / f"{sid}.mp4", _frames(claim, fake, rng, frames, size), fps=fps, audio=sound)
            video = f"videos/{sid}.mp4"
        transcript: str | None = f"Look at this! {claim[0].upper() + claim[1:]}. Share before they delete it."
        metadata = f"title: {claim}; uploader: {rng.choice(UPLOADERS)}; published: {when.date().isoformat()}"
        if rng.random() < missing_transcripts:
            transcript = None  # the ASR expert must supply it
        samples.append(Sample(id=sid, label="fake" if fake else "real", metadata=metadata, transcript=transcript,
                              video=video, published=when, dataset="synthetic", claim=claim))
        if rng.random() < evidence_rate:
            if fake:
                docs.append({"id": f"doc-{sid}", "title": f"FALSE: {claim}",
                             "text": f"Fact check. The claim that {claim} is false. The video was edited.",
                             "url": f"https://factcheck.example/{sid}"})
            else:
                docs.append({"id": f"doc-{sid}", "title": f"CONFIRMED: {claim}",
                             "text": f"News report. Officials confirmed that {claim}. The footage is authentic.",
                             "url": f"https://news.example/{sid}"})
    docs.append({"id": "doc-weather", "title": "Weather", "text": "Sunny tomorrow in every city.",
                 "url": "https://weather.example/1"})
    (out / "samples.jsonl").write_text("".join(s.model_dump_json(exclude_none=True) + "\n" for s in samples))
    (out / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    LocalCorpus.build(out / "corpus.duckdb", docs).close()
    return samples
