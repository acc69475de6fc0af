"""FactGuard data: samples, the three datasets' annotation formats, the temporal split, metrics.

Formats (as the public releases define them; the videos themselves are obtained by the user under
each dataset's agreement and put in ``<dir>/videos/<video_id>.mp4``):

* **FakeSV** (ICTMCG/FakeSV): JSON lines in ``data_complete.json`` (or ``.jsonl``); ``annotation``
  is ``假`` (fake), ``真`` (real) or ``辟谣`` (a debunking video: left out, as the benchmark's own
  splits do); text = ``title`` + ``ocr`` (+ ``keywords``); ``publish_time`` in epoch
  milliseconds.
* **FakeTT** (ICTMCG/FakingRecipe): JSON lines in ``data.json``; ``annotation`` ``fake``/``real``;
  text = ``description`` (+ ``event``); ``publish_time`` epoch milliseconds or a date string.
* **FakeVV** (Fact-R1): no public schema was found; the loader reads the same JSON-lines shape
  (``video_id``, ``label``/``annotation``, ``title``/``description``, ``publish_time``) and says
  which field it could not find.
* Our own normalised ``samples.jsonl`` (:class:`Sample` per line), which the synthetic generator
  writes.

Transcripts: a ``transcript`` (or ``asr``) field when present; otherwise ``None``, and the
environment asks an ASR expert for one (:func:`closedloop.evals.factguard.env.transcribe`).

Split: the newest 15 % by publish time is the test set (the paper's temporal split); samples
without a time sort first (oldest). Metrics: accuracy, precision, recall and F1 with "fake" as the
positive class; Wilson intervals for the proportions and a seeded bootstrap interval for F1.
"""

from __future__ import annotations

import json
import math
import random
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import BaseModel

Label = Literal["real", "fake"]
DATASETS = ("fakesv", "fakett", "fakevv", "samples")

__all__ = ["Sample", "load_samples", "temporal_split", "BinaryMetrics", "binary_metrics", "wilson", "DATASETS"]


class Sample(BaseModel):
    """One video to judge."""

    id: str
    label: Label
    metadata: str = ""
    transcript: str | None = None
    video: str | None = None  # absolute, or relative to the data directory
    published: datetime | None = None
    dataset: str = "samples"
    claim: str | None = None  # synthetic data only: the claim shown in the video


def _time(value: Any) -> datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, (int, float)) or (isinstance(value, str) and value.strip().lstrip("-").isdigit()):
        v = float(value)
        return datetime.fromtimestamp(v / 1000 if v > 1e11 else v, tz=timezone.utc)
    try:
        t = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{no}: not JSON: {e}") from None
    return rows


def _video(root: Path, vid: str) -> str | None:
    for cand in (root / "videos" / f"{vid}.mp4", root / "video" / f"{vid}.mp4"):
        if cand.exists():
            return str(cand)
    return None


def _fakesv(root: Path, path: Path) -> list[Sample]:
    labels = {"假": "fake", "真": "real", "fake": "fake", "real": "real"}
    out = []
    for r in _jsonl(path):
        ann = str(r.get("annotation", "")).strip()
        if ann == "辟谣":
            continue
        if ann not in labels:
            raise ValueError(f"{path}: video {r.get('video_id')}: unknown annotation {ann!r}")
        text = " ".join(str(r.get(k) or "") for k in ("title", "ocr")).strip()
        if r.get("keywords"):
            text += f" (keywords: {r['keywords']})"
        vid = str(r["video_id"])
        out.append(Sample(id=vid, label=labels[ann], metadata=text, transcript=r.get("transcript") or r.get("asr"),
                          video=_video(root, vid), published=_time(r.get("publish_time")), dataset="fakesv"))
    return out


def _generic(root: Path, path: Path, dataset: str) -> list[Sample]:
    out = []
    for r in _jsonl(path):
        vid = r.get("video_id") or r.get("id")
        ann = str(r.get("annotation", r.get("label", ""))).strip().lower()
        ann = {"1": "fake", "0": "real", "true": "real", "false": "fake"}.get(ann, ann)
        if vid is None or ann not in ("fake", "real"):
            raise ValueError(f"{path}: a row needs video_id and annotation/label fake|real, got keys {sorted(r)}")
        text = " ".join(str(r.get(k) or "") for k in ("title", "description")).strip()
        if r.get("event"):
            text += f" (event: {r['event']})"
        out.append(Sample(id=str(vid), label=ann, metadata=text, transcript=r.get("transcript") or r.get("asr"),
                          video=_video(root, str(vid)), published=_time(r.get("publish_time")), dataset=dataset))
    return out


def load_samples(data_dir: str | Path, dataset: str | None = None) -> list[Sample]:
    """Samples of a dataset directory; ``dataset`` is detected from the files when not given."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"FactGuard data directory not found: {root}")
    files = {"samples": ["samples.jsonl"], "fakesv": ["data_complete.json", "data_complete.jsonl"],
             "fakett": ["data.json", "data.jsonl"], "fakevv": ["data.json", "data.jsonl", "annotations.jsonl"]}
    if dataset is None:
        dataset = next((d for d in ("samples", "fakesv", "fakett") if any((root / f).exists() for f in files[d])),
                       None)
        if dataset is None:
            raise ValueError(f"{root}: no samples.jsonl, data_complete.json (FakeSV) or data.json (FakeTT/FakeVV)")
    if dataset not in files:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {', '.join(DATASETS)}")
    path = next((root / f for f in files[dataset] if (root / f).exists()), None)
    if path is None:
        raise FileNotFoundError(f"{root}: none of {files[dataset]} found for {dataset}")
    if dataset == "samples":
        samples = [Sample.model_validate(r) for r in _jsonl(path)]
        return [s.model_copy(update={"video": str(root / s.video)}) if s.video and not Path(s.video).is_absolute()
                else s for s in samples]
    if dataset == "fakesv":
        return _fakesv(root, path)
    return _generic(root, path, dataset)


def temporal_split(samples: list[Sample], test_fraction: float = 0.15) -> tuple[list[Sample], list[Sample]]:
    """(train, test): the newest ``test_fraction`` by publish time is the test set (ties by id)."""
    if not 0 < test_fraction < 1:
        raise ValueError("test_fraction must be in (0, 1)")
    floor = datetime.min.replace(tzinfo=timezone.utc)
    ordered = sorted(samples, key=lambda s: (s.published or floor, s.id))
    n_test = max(1, round(len(ordered) * test_fraction)) if ordered else 0
    return ordered[:len(ordered) - n_test], ordered[len(ordered) - n_test:]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


class BinaryMetrics(BaseModel):
    n: int
    accuracy: float
    precision: float
    recall: float
    f1: float
    accuracy_ci: tuple[float, float]
    precision_ci: tuple[float, float]
    recall_ci: tuple[float, float]
    f1_ci: tuple[float, float]
    tp: int
    fp: int
    tn: int
    fn: int
    unanswered: int


def _f1(tp: int, fp: int, fn: int) -> float:
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def binary_metrics(predictions: Iterable[Label | None], labels: Iterable[Label], *, bootstrap: int = 1000,
                   seed: int = 0) -> BinaryMetrics:
    """Acc/P/R/F1 with "fake" positive; an unanswered prediction counts as "real" (nothing flagged)."""
    pairs = list(zip(predictions, labels, strict=True))
    if not pairs:
        raise ValueError("no predictions to score")
    pos = [(p == "fake", y == "fake") for p, y in pairs]
    tp = sum(p and y for p, y in pos)
    fp = sum(p and not y for p, y in pos)
    fn = sum(not p and y for p, y in pos)
    tn = len(pos) - tp - fp - fn
    rng = random.Random(seed)
    f1s = []
    for _ in range(bootstrap):
        s = [pos[rng.randrange(len(pos))] for _ in pos]
        f1s.append(_f1(sum(p and y for p, y in s), sum(p and not y for p, y in s), sum(not p and y for p, y in s)))
    f1s.sort()
    lo, hi = (f1s[int(0.025 * bootstrap)], f1s[min(bootstrap - 1, int(0.975 * bootstrap))]) if f1s else (0.0, 1.0)
    return BinaryMetrics(n=len(pos), accuracy=(tp + tn) / len(pos), precision=tp / (tp + fp) if tp + fp else 0.0,
                         recall=tp / (tp + fn) if tp + fn else 0.0, f1=_f1(tp, fp, fn),
                         accuracy_ci=wilson(tp + tn, len(pos)), precision_ci=wilson(tp, tp + fp),
                         recall_ci=wilson(tp, tp + fn), f1_ci=(lo, hi), tp=tp, fp=fp, tn=tn, fn=fn,
                         unanswered=sum(p is None for p, _ in pairs))
