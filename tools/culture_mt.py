"""CULTURE-MT: cultural effectiveness of note translation, judged by a model, against BLEU/chrF.

Paper 17 (CULTURE-MT, arXiv 2605.25626; research/papers.md §17): 1,002 user-generated "notes"
(RedNote-style posts, most likely zh→en) over 14 domains and 4 types (culture-loaded symbols ×
linguistic style), scored for "cultural effectiveness" = expression accuracy + cultural
adaptability by a trained JUDGER behind an online leaderboard. Neither the data files nor the
JUDGER are public, so this module supplies the three parts that can be built without them:

* a loader for notes as JSONL/JSON records (our schema below; common aliases are accepted, so the
  official release should load with at most a ``field_map``), with a check of the benchmark's
  published counts (1,002 / 14 / 4);
* :func:`judge` — an LLM judge over any model spec (``closedloop.models.make_client``) that
  follows :data:`RUBRIC`; it is *not* the paper's JUDGER and its scores are not comparable with
  the leaderboard. Effectiveness = w·accuracy + (1−w)·adaptability with w = ½ (the paper does not
  say how the two combine; ``accuracy_weight`` makes the choice explicit). Unparseable replies
  are recorded as failures, never given a score;
* BLEU and chrF through sacrebleu (corpus scores exactly as sacrebleu computes them; per-note
  ``sentence_bleu``/``sentence_chrf`` for the rank correlation), and Spearman ρ / Kendall τ-b
  (scipy) between a surface metric and the judge — the paper's finding is that they are low.

Note schema (one JSON object per line)::

    {"id": "n0001", "domain": "food", "type": "symbol+slang", "source": "...",
     "reference": "...", "src_lang": "zh", "tgt_lang": "en", "culture_items": ["..."]}

``reference`` is optional (judging is reference-free, as judge(src, hyp) in the paper; BLEU needs
it). Hypotheses: JSONL ``{"id": ..., "hypothesis": ...}`` or a .txt file with one line per note in
file order.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal, Sequence

import sacrebleu
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator
from scipy import stats

from closedloop.artifacts import ArtifactError, write_artifact
from closedloop.messages import SystemMessage, UserMessage
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.tool import Tool, tool
from closedloop.tool_models import ModelArg

__all__ = [
    "Note", "load_notes", "load_hypotheses", "benchmark_counts", "check_full_benchmark", "EXPECTED_COUNTS",
    "RUBRIC", "Judgment", "judge_messages", "parse_judgment", "judge", "judge_notes",
    "corpus_scores", "sentence_scores", "rank_correlation", "Correlation", "TOOLS",
]

EXPECTED_COUNTS = {"notes": 1002, "domains": 14, "types": 4}

# ------------------------------------------------------------------------------ data


class Note(BaseModel):
    """One benchmark note. Aliases cover the usual names for each field."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    id: str = Field(validation_alias=AliasChoices("id", "note_id", "uid"))
    domain: str = Field(validation_alias=AliasChoices("domain", "category", "topic"))
    type: str = Field(validation_alias=AliasChoices("type", "note_type", "category_type"))
    source: str = Field(validation_alias=AliasChoices("source", "src", "text", "content"))
    reference: str | None = Field(None, validation_alias=AliasChoices("reference", "ref", "target", "tgt"))
    src_lang: str = "zh"
    tgt_lang: str = "en"
    culture_items: list[str] = Field(default_factory=list)

    @field_validator("id", mode="before")
    @classmethod
    def _id_as_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) else v

    @field_validator("source", "domain", "type")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v


def _resolve(path: str | Path, what: str) -> Path:
    from closedloop.artifacts import resolve_array_path

    return resolve_array_path(str(path), what)  # inside the working root, or refused


def _read_records(path: str | Path, what: str) -> list[dict[str, Any]]:
    p = _resolve(path, what)
    if not p.is_file():
        raise ArtifactError(f"{what}: file not found: {path}")
    if p.stat().st_size > 256 * 2**20:
        raise ArtifactError(f"{what}: {p.name} is over 256 MiB")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{what}: {p} is not valid JSON: {e}") from None
        if isinstance(data, dict):  # {"notes": [...]} or {"data": [...]}
            data = next((data[k] for k in ("notes", "data", "items") if isinstance(data.get(k), list)), None)
        if not isinstance(data, list):
            raise ArtifactError(f"{what}: {p} must hold a JSON list of records (or {{'notes': [...]}})")
        return data
    if p.suffix != ".jsonl":
        raise ArtifactError(f"{what}: unsupported file type {p.suffix!r} (use .jsonl or .json)")
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ArtifactError(f"{what}: {p} line {n} is not valid JSON: {e}") from None
    return out


def load_notes(path: str | Path, field_map: dict[str, str] | None = None) -> list[Note]:
    """Load notes from .jsonl/.json; ``field_map`` renames file fields to ours ({"their": "ours"})."""
    notes, seen = [], set()
    for i, rec in enumerate(_read_records(path, "notes"), 1):
        if not isinstance(rec, dict):
            raise ArtifactError(f"notes: record {i} is not a JSON object")
        if field_map:
            rec = {field_map.get(k, k): v for k, v in rec.items()}
        try:
            note = Note.model_validate(rec)
        except ValidationError as e:
            errs = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise ArtifactError(f"notes: record {i} is not a valid note ({errs})") from None
        if note.id in seen:
            raise ArtifactError(f"notes: duplicate id {note.id!r} (record {i})")
        seen.add(note.id)
        notes.append(note)
    if not notes:
        raise ArtifactError(f"notes: {path} holds no notes")
    return notes


def load_hypotheses(path: str | Path, notes: Sequence[Note]) -> list[str]:
    """Hypotheses aligned with ``notes``: JSONL/JSON by id, or .txt one line per note in order."""
    p = _resolve(path, "hypotheses")
    if p.suffix == ".txt":
        if not p.is_file():
            raise ArtifactError(f"hypotheses: file not found: {path}")
        lines = p.read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines = lines[:-1]
        if len(lines) != len(notes):
            raise ArtifactError(f"hypotheses: {p} has {len(lines)} lines for {len(notes)} notes")
        return lines
    by_id: dict[str, str] = {}
    for i, rec in enumerate(_read_records(p, "hypotheses"), 1):
        hyp = next((rec.get(k) for k in ("hypothesis", "translation", "hyp", "output") if k in rec), None) \
            if isinstance(rec, dict) else None
        if not isinstance(hyp, str) or "id" not in rec:
            raise ArtifactError(f"hypotheses: record {i} needs 'id' and a string 'hypothesis'")
        by_id[str(rec["id"])] = hyp
    missing = [n.id for n in notes if n.id not in by_id]
    if missing:
        raise ArtifactError(f"hypotheses: no hypothesis for {len(missing)} note(s), e.g. {missing[:3]}")
    return [by_id[n.id] for n in notes]


def benchmark_counts(notes: Sequence[Note]) -> dict[str, Any]:
    return {"notes": len(notes), "domains": dict(sorted(Counter(n.domain for n in notes).items())),
            "types": dict(sorted(Counter(n.type for n in notes).items()))}


def check_full_benchmark(notes: Sequence[Note]) -> None:
    """Raise unless the notes have the published shape: 1,002 notes, 14 domains, 4 types."""
    got = {"notes": len(notes), "domains": len({n.domain for n in notes}), "types": len({n.type for n in notes})}
    bad = [f"{k} {got[k]} (expected {v})" for k, v in EXPECTED_COUNTS.items() if got[k] != v]
    if bad:
        raise ValueError("not the full CULTURE-MT benchmark: " + ", ".join(bad))


# ------------------------------------------------------------------------------ judge

RUBRIC = """You evaluate translations of user-generated social-media notes. Score two criteria, each an integer 1-5.

Expression accuracy: is the note's meaning carried over faithfully and fluently?
5 = all content, facts, sentiment and tone preserved; natural, grammatical target language.
4 = minor slips in wording or nuance; nothing of substance lost or added.
3 = the main point survives, but some details are lost, added or distorted, or phrasing is awkward.
2 = substantial mistranslation or omission; a reader would misunderstand parts of the note.
1 = the meaning is lost, or the output is not a translation of the note.

Cultural adaptability: are culture-loaded elements (idioms, slang, internet memes, allusions, festivals, food,
place and brand names, platform jargon) rendered so a target-culture reader gets their intended meaning and effect,
and is the note's register (casual tone, emoji, hashtags, humour) kept?
5 = every culture-loaded element is rendered with an equivalent expression, a natural adaptation or a brief gloss;
    the register feels native to the target platform.
4 = nearly all are handled well; one is slightly stiff or over-explained.
3 = some are translated literally so their meaning or effect is partly lost, or the register is flattened.
2 = most are literal, transliterated without explanation, or wrong; the register does not fit.
1 = the cultural content is lost or misrepresented.

Judge the translation against the source note; a reference translation, if shown, is only one acceptable version.
Reply with one JSON object and nothing after it:
{"accuracy": <1-5>, "adaptability": <1-5>, "rationale": "<one or two sentences>"}"""


class Judgment(BaseModel):
    id: str
    accuracy: int | None = None
    adaptability: int | None = None
    effectiveness: float | None = None
    rationale: str | None = None
    error: str | None = None  # set when the reply could not be parsed or the call failed
    raw: str | None = None


class _Scores(BaseModel):
    accuracy: Annotated[int, Field(ge=1, le=5)]
    adaptability: Annotated[int, Field(ge=1, le=5)]
    rationale: str = ""


def judge_messages(source: str, hypothesis: str, *, reference: str | None = None, src_lang: str = "zh",
                   tgt_lang: str = "en", domain: str | None = None) -> list[Any]:
    """The judge's conversation: the rubric as system prompt, the note and its translation as user turn."""
    parts = [f"Domain: {domain}" if domain else None, f"Source note ({src_lang}):\n{source}",
             f"Reference translation ({tgt_lang}):\n{reference}" if reference else None,
             f"Translation to evaluate ({tgt_lang}):\n{hypothesis}"]
    return [SystemMessage(content=RUBRIC), UserMessage(content="\n\n".join(p for p in parts if p))]


_JSON_OBJ = re.compile(r"\{[^{}]*\}", re.S)


def parse_judgment(text: str) -> _Scores:
    """The last JSON object in the reply with integer accuracy and adaptability in 1..5."""
    for match in reversed(_JSON_OBJ.findall(text or "")):
        try:
            data = json.loads(match)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "accuracy" in data and "adaptability" in data:
            try:
                return _Scores.model_validate({**data, "rationale": str(data.get("rationale", ""))})
            except ValidationError as e:
                raise ValueError(f"judge scores out of the rubric's range: {e.errors()[0]['msg']}") from None
    raise ValueError("no JSON object with 'accuracy' and 'adaptability' in the judge's reply")


async def judge(client: ModelClient, note: Note, hypothesis: str, *, include_reference: bool = False,
                accuracy_weight: float = 0.5, params: SamplingParams | None = None) -> Judgment:
    """Score one translation with the rubric; failures are recorded on the judgment, not raised."""
    msgs = judge_messages(note.source, hypothesis, reference=note.reference if include_reference else None,
                          src_lang=note.src_lang, tgt_lang=note.tgt_lang, domain=note.domain)
    try:
        turn = await client.generate(msgs, params=params or SamplingParams(temperature=0.0, max_tokens=256))
    except Exception as e:  # a failed call is one failed judgment, not a failed run
        return Judgment(id=note.id, error=f"judge call failed: {type(e).__name__}: {e}")
    text = turn.message.text
    try:
        s = parse_judgment(text)
    except ValueError as e:
        return Judgment(id=note.id, error=str(e), raw=text[:500])
    eff = accuracy_weight * s.accuracy + (1 - accuracy_weight) * s.adaptability
    return Judgment(id=note.id, accuracy=s.accuracy, adaptability=s.adaptability, effectiveness=eff,
                    rationale=s.rationale)


async def judge_notes(client: ModelClient, notes: Sequence[Note], hypotheses: Sequence[str], *,
                      include_reference: bool = False, accuracy_weight: float = 0.5, concurrency: int = 4,
                      params: SamplingParams | None = None) -> list[Judgment]:
    """Judge every (note, hypothesis) pair, ``concurrency`` calls at a time, in note order."""
    if len(notes) != len(hypotheses):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(notes)} notes")
    if not 0.0 <= accuracy_weight <= 1.0:
        raise ValueError("accuracy_weight must be in [0, 1]")
    sem = asyncio.Semaphore(max(1, concurrency))

    async def one(n: Note, h: str) -> Judgment:
        async with sem:
            return await judge(client, n, h, include_reference=include_reference, accuracy_weight=accuracy_weight,
                               params=params)

    return list(await asyncio.gather(*(one(n, h) for n, h in zip(notes, hypotheses))))


# ------------------------------------------------------------------------------ metrics


def _tokenizer(tgt_lang: str) -> str:
    """sacrebleu's recommended tokeniser for the target language."""
    return {"zh": "zh", "ja": "char", "ko": "char", "th": "char"}.get(tgt_lang.split("-")[0].lower(), "13a")


def _refs(notes: Sequence[Note]) -> list[str]:
    missing = [n.id for n in notes if n.reference is None]
    if missing:
        raise ValueError(f"BLEU/chrF need references; {len(missing)} note(s) have none, e.g. {missing[:3]}")
    return [n.reference or "" for n in notes]


def corpus_scores(notes: Sequence[Note], hypotheses: Sequence[str]) -> dict[str, Any]:
    """Corpus BLEU and chrF (sacrebleu defaults; tokeniser by target language) and their signatures."""
    if len(notes) != len(hypotheses):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(notes)} notes")
    tok = _tokenizer(notes[0].tgt_lang)
    bleu, chrf = sacrebleu.metrics.BLEU(tokenize=tok), sacrebleu.metrics.CHRF()
    refs = [_refs(notes)]
    b, c = bleu.corpus_score(list(hypotheses), refs), chrf.corpus_score(list(hypotheses), refs)
    return {"bleu": b.score, "chrf": c.score, "bleu_signature": str(bleu.get_signature()),
            "chrf_signature": str(chrf.get_signature())}


def sentence_scores(notes: Sequence[Note], hypotheses: Sequence[str]) -> tuple[list[float], list[float]]:
    """Per-note sentence BLEU (effective-order smoothing, as sacrebleu.sentence_bleu) and chrF."""
    if len(notes) != len(hypotheses):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(notes)} notes")
    refs = _refs(notes)
    bleu = sacrebleu.metrics.BLEU(tokenize=_tokenizer(notes[0].tgt_lang), effective_order=True)
    chrf = sacrebleu.metrics.CHRF()
    return ([bleu.sentence_score(h, [r]).score for h, r in zip(hypotheses, refs)],
            [chrf.sentence_score(h, [r]).score for h, r in zip(hypotheses, refs)])


class Correlation(BaseModel):
    n: int
    spearman: float | None
    spearman_p: float | None
    kendall_tau_b: float | None
    kendall_p: float | None
    note: str | None = None


def rank_correlation(x: Sequence[float | None], y: Sequence[float | None]) -> Correlation:
    """Spearman ρ and Kendall τ-b over the pairs where both values exist (ties handled by both)."""
    if len(x) != len(y):
        raise ValueError(f"length mismatch: {len(x)} vs {len(y)}")
    pairs = [(float(a), float(b)) for a, b in zip(x, y) if a is not None and b is not None]
    if any(not (math.isfinite(a) and math.isfinite(b)) for a, b in pairs):
        raise ValueError("scores contain NaN or infinite values")
    n = len(pairs)
    if n < 3:
        return Correlation(n=n, spearman=None, spearman_p=None, kendall_tau_b=None, kendall_p=None,
                           note="need at least 3 scored pairs")
    a, b = zip(*pairs)
    if len(set(a)) == 1 or len(set(b)) == 1:
        return Correlation(n=n, spearman=None, spearman_p=None, kendall_tau_b=None, kendall_p=None,
                           note="one of the score lists is constant: rank correlation is undefined")
    s, k = stats.spearmanr(a, b), stats.kendalltau(a, b, variant="b")
    return Correlation(n=n, spearman=float(s.statistic), spearman_p=float(s.pvalue),
                       kendall_tau_b=float(k.statistic), kendall_p=float(k.pvalue))


# ------------------------------------------------------------------------------ tools


class NotesReport(BaseModel):
    notes: int
    domains: dict[str, int]
    types: dict[str, int]
    with_reference: int
    language_pairs: dict[str, int]
    full_benchmark: bool | None  # None unless check_full was asked


@tool
def culture_mt_notes(notes_path: str, check_full: bool = False) -> NotesReport:
    """Load CULTURE-MT notes and count them by domain and type; optionally check the published shape (1,002 notes,
    14 domains, 4 types) and fail with what differs.

    Args:
        notes_path: .jsonl (one note per line) or .json list with id, domain, type, source, optional reference.
        check_full: Raise unless the file is the full benchmark.
    """
    notes = load_notes(notes_path)
    if check_full:
        check_full_benchmark(notes)
    c = benchmark_counts(notes)
    return NotesReport(notes=c["notes"], domains=c["domains"], types=c["types"],
                       with_reference=sum(n.reference is not None for n in notes),
                       language_pairs=dict(Counter(f"{n.src_lang}-{n.tgt_lang}" for n in notes)),
                       full_benchmark=True if check_full else None)


class MetricsReport(BaseModel):
    n: int
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    bleu_by_type: dict[str, float]


@tool
def culture_mt_metrics(notes_path: str, hypotheses_path: str) -> MetricsReport:
    """Corpus BLEU and chrF (sacrebleu) of translations against the notes' references, overall and per note type.

    Args:
        notes_path: Notes .jsonl/.json with references.
        hypotheses_path: .jsonl with {"id", "hypothesis"} per note, or .txt with one line per note in order.
    """
    notes = load_notes(notes_path)
    hyps = load_hypotheses(hypotheses_path, notes)
    overall = corpus_scores(notes, hyps)
    by_type = {}
    for t in sorted({n.type for n in notes}):
        idx = [i for i, n in enumerate(notes) if n.type == t]
        by_type[t] = corpus_scores([notes[i] for i in idx], [hyps[i] for i in idx])["bleu"]
    return MetricsReport(n=len(notes), bleu_by_type=by_type, **overall)


class JudgeReport(BaseModel):
    judge_model: str
    n: int
    judged: int
    failed: int
    first_error: str | None
    accuracy_mean: float | None
    adaptability_mean: float | None
    effectiveness_mean: float | None
    bleu_vs_judge: Correlation | None  # sentence BLEU vs effectiveness; None without references
    chrf_vs_judge: Correlation | None
    judgments_path: str  # JSONL: one record per note with scores, sentence BLEU/chrF, rationale


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


@tool(timeout_s=3600)
async def culture_mt_judge(notes_path: str, hypotheses_path: str, judge_model: ModelArg,
                           max_notes: Annotated[int, Field(ge=1)] | None = None,
                           include_reference: bool = False,
                           accuracy_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5,
                           concurrency: Annotated[int, Field(ge=1, le=64)] = 4,
                           max_tokens: Annotated[int, Field(ge=16, le=4096)] = 256) -> JudgeReport:
    """Judge translations for expression accuracy and cultural adaptability (1-5 each, rubric in
    closedloop.tools.culture_mt.RUBRIC) with any model, and rank-correlate the judge with sentence BLEU/chrF.
    Not the paper's JUDGER: scores are not comparable with its leaderboard.

    Args:
        notes_path: Notes .jsonl/.json.
        hypotheses_path: .jsonl with {"id", "hypothesis"} per note, or .txt with one line per note.
        judge_model: Model spec: hf:<checkpoint directory inside the working root>, or an openai:<model>[@base_url] / hub id the operator allowed (CLOSEDLOOP_TOOL_MODELS).
        max_notes: Judge only the first N notes.
        include_reference: Show the reference translation to the judge (default: reference-free, as the paper).
        accuracy_weight: w in effectiveness = w * accuracy + (1 - w) * adaptability.
        concurrency: Judge calls in flight at once.
        max_tokens: Token budget of each judge reply.
    """
    from closedloop.models import make_client

    notes = load_notes(notes_path)
    hyps = load_hypotheses(hypotheses_path, notes)
    if max_notes is not None:
        notes, hyps = notes[:max_notes], hyps[:max_notes]
    client = make_client(judge_model)
    try:
        js = await judge_notes(client, notes, hyps, include_reference=include_reference,
                               accuracy_weight=accuracy_weight, concurrency=concurrency,
                               params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
    finally:
        await client.aclose()
    has_refs = all(n.reference is not None for n in notes)
    bleu, chrf = sentence_scores(notes, hyps) if has_refs else ([None] * len(notes), [None] * len(notes))
    eff = [j.effectiveness for j in js]
    data = "".join(json.dumps({**j.model_dump(), "domain": n.domain, "type": n.type, "hypothesis": h,
                               "sentence_bleu": b, "sentence_chrf": c}, ensure_ascii=False) + "\n"
                   for n, h, j, b, c in zip(notes, hyps, js, bleu, chrf)).encode("utf-8")

    def write(f: BinaryIO) -> None:
        f.write(data)

    out = write_artifact("culture-mt-judgments", ".jsonl", write, reserve_bytes=len(data))
    failed = [j for j in js if j.error]
    return JudgeReport(
        judge_model=judge_model, n=len(notes), judged=len(js) - len(failed), failed=len(failed),
        first_error=failed[0].error if failed else None, accuracy_mean=_mean([j.accuracy for j in js]),
        adaptability_mean=_mean([j.adaptability for j in js]), effectiveness_mean=_mean(eff),
        bleu_vs_judge=rank_correlation(bleu, eff) if has_refs else None,
        chrf_vs_judge=rank_correlation(chrf, eff) if has_refs else None, judgments_path=str(out))


@tool
def culture_mt_correlation(judgments_path: str, metric: Literal["sentence_bleu", "sentence_chrf"] = "sentence_bleu",
                           judge_score: Literal["effectiveness", "accuracy", "adaptability"] = "effectiveness",
                           by: Literal["none", "type", "domain"] = "none") -> dict[str, Correlation]:
    """Spearman and Kendall tau-b between a surface metric and a judge score in a judgments file written by
    culture_mt_judge, overall or per note type/domain.

    Args:
        judgments_path: JSONL from culture_mt_judge.
        metric: sentence_bleu or sentence_chrf.
        judge_score: effectiveness, accuracy or adaptability.
        by: Group by note type or domain ('none': one overall correlation).
    """
    recs = _read_records(judgments_path, "judgments")
    for i, r in enumerate(recs, 1):
        if not isinstance(r, dict) or metric not in r or judge_score not in r:
            raise ArtifactError(f"judgments: record {i} lacks {metric!r} or {judge_score!r}")
    groups: dict[str, list[dict[str, Any]]] = {"all": recs} if by == "none" else {}
    if by != "none":
        for r in recs:
            groups.setdefault(str(r.get(by)), []).append(r)
    return {g: rank_correlation([r[metric] for r in rs], [r[judge_score] for r in rs]) for g, rs in sorted(groups.items())}


TOOLS: list[Tool] = [culture_mt_notes, culture_mt_metrics, culture_mt_judge, culture_mt_correlation]
