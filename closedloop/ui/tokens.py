"""The token view of one turn: the sampled ids as text pieces with their loss mask, logprob and
(for GRPO rollouts) the per-token advantage the trainer used.

Text pieces come from the model's own ``tokenizer.json`` (the ``tokenizers`` library, no model
code runs) decoded incrementally: a piece is what decoding up to that token adds to the text,
so a character split over several byte tokens appears once, on the token that completes it, and
the tokens before it are shown as parts of it. Without a tokenizer the view shows the ids.

Advantages are not stored: they are recomputed from the stored rollouts of the same training
step with the run's own config and the trainers' own rule
(:func:`closedloop.trainers.advantages.turn_level_advantages`). Where that cannot give the
numbers the trainer used (reward functions or cost constraints, whose values are not stored;
groups that cannot be told apart), the view says so instead of guessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from closedloop.messages import Turn
from closedloop.store import RunRecord, RunStore

__all__ = ["TOKEN_PAGE", "TokenPiece", "TokenTable", "find_tokenizer", "token_table", "rollout_advantages", "logprob_class",
           "advantage_class"]

_SPEC_PREFIXES = ("hf:", "vllm:", "policy:")


@dataclass(frozen=True, slots=True)
class TokenPiece:
    position: int  # index in prompt_ids + completion_ids
    token_id: int
    text: str  # "" for a token whose bytes complete in a later token's piece
    mask: int | None
    logprob: float | None  # completion tokens only
    advantage: float | None
    completion: bool

    @property
    def title(self) -> str:
        """What hovering a token shows."""
        parts = [f"#{self.position}", f"id {self.token_id}",
                 "completion" if self.completion else "prompt",
                 f"mask {self.mask}" if self.mask is not None else "mask -"]
        if self.logprob is not None:
            parts.append(f"logprob {self.logprob:.4f} (p {math.exp(self.logprob):.3f})")
        if self.advantage is not None:
            parts.append(f"advantage {self.advantage:+.4f}")
        return " · ".join(parts)


@dataclass
class TokenTable:
    pieces: list[TokenPiece]
    tokenizer: str | None  # the tokenizer.json used, or None: ids only
    tokenizer_note: str  # why there is no tokenizer, or where it came from
    trained: int  # tokens with mask 1 (whole turn)
    context: int  # tokens with mask 0 (whole turn)
    start: int  # position of the first piece
    total: int  # tokens in the turn

    @property
    def end(self) -> int:
        return self.start + len(self.pieces)


def _candidate_dirs(specs: Iterable[str | None]) -> list[Path]:
    out = []
    for spec in specs:
        if not spec:
            continue
        text = spec
        for prefix in _SPEC_PREFIXES:
            if text.startswith(prefix):
                text = text[len(prefix):]
                break
        if "://" in text or text.startswith("openai:"):
            continue
        out.append(Path(text).expanduser())
    return out


def find_tokenizer(specs: Iterable[str | None], override: str | None = None) -> tuple[str | None, str]:
    """The ``tokenizer.json`` to decode with: ``override`` (a file or a model directory), else the
    first of the model specs (turn model, run model, parent run model) that is a local directory
    holding one. Returns (path or None, a note for the page)."""
    if override:
        p = Path(override).expanduser()
        path = p / "tokenizer.json" if p.is_dir() else p
        if path.is_file():
            return str(path), f"--tokenizer {override}"
        return None, f"--tokenizer {override}: no tokenizer.json there"
    tried = []
    for d in _candidate_dirs(specs):
        tried.append(str(d))
        path = d / "tokenizer.json"
        try:
            if path.is_file():
                return str(path), f"from {d}"
        except OSError:
            continue
    why = ("no model directory with a tokenizer.json among " + ", ".join(tried)) if tried else \
        "the model is remote (no local tokenizer)"
    return None, why + "; start the viewer with --tokenizer DIR to see text"


@lru_cache(maxsize=8)
def _tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def decode_pieces(tokenizer: Any, ids: list[int], window: int = 6) -> list[str]:
    """One text piece per id such that ``"".join(pieces)`` is the decoded text (special tokens
    kept). A token whose bytes end mid-character gets ``""``; the completed character goes to the
    token that completes it. Each step decodes only a few tokens of context (``window``), so
    this is linear in the number of ids."""
    pieces = [""] * len(ids)
    prefix, emitted = 0, 0  # decode context start; first id whose text is not emitted yet
    for i in range(len(ids)):
        before = tokenizer.decode(ids[prefix:emitted], skip_special_tokens=False)
        text = tokenizer.decode(ids[prefix:i + 1], skip_special_tokens=False)
        if len(text) > len(before) and not text.endswith("\ufffd"):
            pieces[i] = text[len(before):]
            emitted = i + 1
            prefix = max(prefix, emitted - window)
    if emitted < len(ids):  # text that really ends in U+FFFD: give it to the last token
        before = tokenizer.decode(ids[prefix:emitted], skip_special_tokens=False)
        pieces[-1] = tokenizer.decode(ids[prefix:], skip_special_tokens=False)[len(before):]
    return pieces


TOKEN_PAGE = 4096  # tokens per page of the token view: a 300k-token completion must not become one page


def token_table(turn: Turn, tokenizer_path: str | None, note: str, advantage: float | None = None, *,
                start: int = 0, limit: int = TOKEN_PAGE) -> TokenTable:
    """Tokens ``[start, start + limit)`` of ``turn`` (prompt then completion) with what the store
    recorded for each. ``advantage``: the turn's advantage (one per turn, on its trained tokens)."""
    prompt = list(turn.prompt_ids or [])
    completion = list(turn.completion_ids or [])
    ids = prompt + completion
    mask = list(turn.loss_mask) if turn.loss_mask is not None else None
    start = max(0, min(start, len(ids)))
    end = min(len(ids), start + limit)
    context = max(0, start - 8)  # a few tokens before the page, so its first piece decodes as in the whole
    texts = decode_pieces(_tokenizer(tokenizer_path), ids[context:end])[start - context:] if tokenizer_path else []
    pieces = []
    for pos in range(start, end):
        tid = ids[pos]
        is_completion = pos >= len(prompt)
        lp = float(turn.logprobs[pos - len(prompt)]) if is_completion and turn.logprobs is not None else None
        m = int(mask[pos]) if mask is not None else None
        adv = advantage if (advantage is not None and m == 1) else None
        text = texts[pos - start] if tokenizer_path else f"\u27e8{tid}\u27e9"
        pieces.append(TokenPiece(pos, int(tid), text, m, lp, adv, is_completion))
    trained = sum(1 for v in mask if v == 1) if mask is not None else 0
    return TokenTable(pieces, tokenizer_path, note, trained, (len(mask) - trained) if mask is not None else 0,
                      start, len(ids))


def logprob_class(lp: float | None) -> str:
    """A colour bucket of the sampled token's probability (CSS classes; no inline styles under the CSP)."""
    if lp is None:
        return "lpn"
    p = math.exp(lp)
    for i, edge in enumerate((0.05, 0.2, 0.5, 0.8, 0.95)):
        if p < edge:
            return f"lp{i}"
    return "lp5"


def advantage_class(adv: float | None) -> str:
    if adv is None:
        return "avx"
    mag = abs(adv)
    level = 0 if mag < 1e-9 else 1 if mag < 0.25 else 2 if mag < 0.75 else 3
    if level == 0:
        return "av0"
    return f"av{'p' if adv > 0 else 'n'}{level}"


def rollout_advantages(store: RunStore, run: RunRecord) -> tuple[list[float] | None, str]:
    """Per-turn advantages of a GRPO rollout run, recomputed as the trainer computed them, or
    (None, why not)."""
    if run.kind != "rollout" or run.parent_id is None:
        return None, "only GRPO rollouts have advantages"
    step_tags = [t for t in run.tags if t.startswith("step:")]
    if not step_tags:
        return None, "the rollout has no step:N tag"
    parent = store.get_run(run.parent_id, media="refs")
    cfg = parent.config or {}
    if cfg.get("reward_funcs") or cfg.get("constraints"):
        return None, ("the run used reward functions or cost constraints, whose values are not stored; "
                      "the advantages cannot be recomputed exactly")
    if "scale_rewards" not in cfg:
        return None, "the parent run is not a GRPO run (no scale_rewards in its config)"
    siblings = list(store.iter_trajectories(parent_id=run.parent_id, tag=step_tags[0], media="refs"))
    keys = [(t.metadata.get("group"), t.metadata.get("sample")) for t in siblings]
    if any(g is None for g, _ in keys) or len(set(keys)) != len(keys):
        return None, ("the step's groups cannot be told apart from the stored metadata (group/sample missing, "
                      "or one seed drawn twice in the step)")
    from closedloop.trainers.advantages import turn_level_advantages
    from closedloop.trainers.grpo_batch import RewardSpec

    spec = RewardSpec(weights={str(k): float(v) for k, v in (cfg.get("reward_weights") or {}).items()},
                      turn_components=[str(c) for c in cfg.get("turn_reward_components") or []])
    finals, per_turn = [], []
    for t in siblings:
        final, turns, _ = spec.score(t)
        finals.append(final)
        per_turn.append(turns)
    adv = turn_level_advantages(finals, per_turn, [g for g, _ in keys], gamma=float(cfg.get("gamma", 1.0)),
                                turn_weight=float(cfg.get("turn_weight", 1.0)), scale=cfg["scale_rewards"],
                                turn_baseline=cfg.get("turn_baseline", "group"),
                                missing=cfg.get("missing_turn_rewards", "zero"))
    index = next(i for i, t in enumerate(siblings) if t.id == run.id)
    return adv[index], (f"recomputed from the {len(siblings)} rollouts of {step_tags[0]} with the run's reward "
                        f"config (scale {cfg['scale_rewards']}, {len(set(g for g, _ in keys))} groups)")
