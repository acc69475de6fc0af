"""ZipRerank: single-pass listwise reranking, QI-EI patch pruning and the two ranking losses.

Paper 10 in research/papers.md; official code dukesun99/ZipRerank (no licence file, so nothing is
copied; the behaviour below follows its ``scripts/evaluate.py``, ``utils/data_utils.py``,
``utils/loss.py`` and ``models/qi_early_pruner.py``).

* **Listwise scorer, one forward per window.** Candidates are labelled [A], [B], … in a RankGPT
  prompt (the official wording), the chat template's generation prompt is followed by ``[``, and
  score_i = the next-token logit of the *first token* of letter i. Sorting the scores gives the
  ranking: no decoding, so a window of N candidates costs one forward instead of ~4N generated
  tokens. Windows hold at most 26 candidates (letters A–Z; the paper uses 20). Longer lists are
  reranked RankGPT-style with windows sliding from the tail to the head (``stride``), one forward
  each.
* **QI-EI** (query-image early interaction): s_p = max_t cos(text_t, patch_p); keep the
  k = max(1, round(ρ·N)) best patches, restored to spatial (index) order. ``round`` is Python's
  (half to even), as in the official pruner; ``rounding="ceil"`` keeps ⌈ρN⌉ instead. ρ = 1 keeps
  everything in order (a no-op).
* **Soft-ranking loss** (stage 2): ground-truth candidates first, the rest in the teacher's order;
  target weight decay^position, normalised; L = −Σ target · log softmax(scores).
* **RankNet** (stage 1): BCE-with-logits on s_i − s_j over pairs with rel_i > rel_j (mean).
* **Evaluation**: recall@k = |relevant ∩ top-k| / |relevant| and binary nDCG@k, macro-averaged over
  queries of a local JSONL ranking set (``{"query", "candidates", "relevant"}`` per line), for the
  first-stage order and the reranked order.

Which models: any ``hf:`` causal LM for text candidates (tested with the tiny Qwen2-style LM of
closedloop/models/tiny.py), and a VLM with a processor for page images (the paper's setting): the
same prompt with the images after the text, as the official code does (:func:`build_vlm_inputs`).
The image path is tested with a tiny random Qwen2-VL built in the test, with a small stand-in for
``Qwen2VLProcessor`` (its video half needs torchvision, which has no CPU build for the pinned
torch), and end to end through ``from_spec("hf:DIR")`` and the tool with the tiny LLaVA of
:mod:`closedloop.models.tiny_vlm` (a real processor, loaded as any VLM checkpoint is). QI-EI is a function on embeddings (tested on that VLM's patch embeddings),
not spliced into a vision tower's forward as the official Qwen3-VL subclass does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field

from closedloop.artifacts import ArrayInput, ArtifactError, load_array
from closedloop.tool import Tool, tool
from closedloop.tool_models import ModelArg

__all__ = ["LABELS", "ranking_prompt", "ListwiseReranker", "listwise_rerank", "n_windows", "qi_ei_scores", "qi_ei_prune", "soft_targets",
           "soft_ranking_loss", "ranknet_loss", "recall_at_k", "ndcg_at_k", "RankingExample",
           "load_ranking_set", "evaluate_ranking_set", "TOOLS"]

LABELS = [chr(ord("A") + i) for i in range(26)]
Rounding = Literal["round", "ceil"]


# ---------------------------------------------------------------------------------- scorer


def ranking_prompt(query: str, passages: Sequence[str] | int) -> str:
    """The official RankGPT-style prompt; text passages are listed as ``[A] text`` lines."""
    n = passages if isinstance(passages, int) else len(passages)
    parts = ["You are RankGPT, an intelligent assistant that can rank passages based on their relevancy to the query.",
             ""]
    if isinstance(passages, int):
        parts += [f"I will provide you with {n} passages as images.",
                  "Rank the passages based on their relevance to the search query.", "",
                  "The images are provided in order: "
                  + ", ".join(f"Picture {i + 1} is passage [{LABELS[i]}]" for i in range(n)) + ".", ""]
    else:
        parts += [f"I will provide you with {n} passages, each indicated by an identifier [].",
                  "Rank the passages based on their relevance to the search query.", ""]
        parts += [f"[{LABELS[i]}] {p}" for i, p in enumerate(passages)] + [""]
    parts += [f"Search Query: {query}", "",
              "Rank the passages above based on their relevance to the search query.",
              "The passages should be listed in descending order using identifiers.",
              "The most relevant passages should be listed first.",
              "The output format should be [A] > [B], etc.",
              "Only output the ranking results, do not say anything else."]
    return "\n".join(parts)


def build_vlm_inputs(processor, query: str, images: Sequence[Any]) -> dict[str, torch.Tensor]:
    """VLM inputs as in the official code: text then images in one user turn, generation prompt, ``[``."""
    messages = [{"role": "user", "content": [{"type": "text", "text": ranking_prompt(query, len(images))}]
                 + [{"type": "image", "image": img} for img in images]}]
    inputs = processor.apply_chat_template([messages], tokenize=True, add_generation_prompt=True,
                                           return_dict=True, return_tensors="pt")
    bracket = processor.tokenizer.encode("[", add_special_tokens=False)[0]
    inputs = dict(inputs)
    length = inputs["input_ids"].shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[bracket]])], 1)
    # Per-token side inputs grow with it: attended, and a text (not image) token.
    for key, fill in (("attention_mask", 1), ("mm_token_type_ids", 0), ("token_type_ids", 0)):
        if key in inputs and inputs[key].ndim == 2 and inputs[key].shape[1] == length:
            inputs[key] = torch.cat([inputs[key], torch.full((1, 1), fill, dtype=inputs[key].dtype)], 1)
    return inputs


@dataclass
class ListwiseReranker:
    """Scores a window of candidates with one forward pass of a causal LM (or VLM with a processor)."""

    model: Any
    tokenizer: Any
    window: int = 20
    stride: int = 10
    processor: Any = None
    n_forwards: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.window <= len(LABELS):
            raise ValueError(f"window must be in 1..{len(LABELS)} (one letter per candidate), got {self.window}")
        if not 1 <= self.stride <= self.window:
            raise ValueError(f"stride must be in 1..window ({self.window}), got {self.stride}")
        ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in LABELS[: self.window]]
        if any(not t for t in ids):
            raise ValueError("the tokenizer encodes a label letter to no tokens")
        self.label_ids = [t[0] for t in ids]
        if len(set(self.label_ids)) != len(self.label_ids):
            raise ValueError("label letters share a first token: their logits cannot tell candidates apart")
        self.bracket_id = self.tokenizer.encode("[", add_special_tokens=False)[0]

    @classmethod
    def from_spec(cls, spec: str, **kwargs) -> "ListwiseReranker":
        """``hf:<dir>``: a local checkpoint (no hub access), float32 on CPU. A vision-language
        checkpoint (one with a processor, see :func:`closedloop.models.hf_vision.is_vision_checkpoint`)
        loads with its processor and reranks page images; a causal LM reranks text."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from closedloop.models import parse_spec
        from closedloop.models.hf_vision import is_vision_checkpoint

        s = parse_spec(spec)
        if s.backend != "hf":
            raise ValueError(f"need an hf:<path> model spec, got {spec!r}")
        if not Path(s.model).is_dir():
            raise FileNotFoundError(f"model directory not found: {s.model}")
        if is_vision_checkpoint(s.model):
            from transformers import AutoModelForImageTextToText, AutoProcessor

            processor = AutoProcessor.from_pretrained(s.model)
            model = AutoModelForImageTextToText.from_pretrained(s.model, dtype=torch.float32).eval()
            return cls(model, processor.tokenizer, processor=processor, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32).eval()
        return cls(model, AutoTokenizer.from_pretrained(s.model), **kwargs)

    @property
    def reads_images(self) -> bool:
        return self.processor is not None

    def text_inputs(self, query: str, passages: Sequence[str]) -> dict[str, torch.Tensor]:
        prompt = ranking_prompt(query, passages)
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                     add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = list(ids)
        else:
            ids = self.tokenizer.encode(prompt + "\n", add_special_tokens=True)
        ids.append(self.bracket_id)
        t = torch.tensor([ids])
        return {"input_ids": t, "attention_mask": torch.ones_like(t)}

    @torch.no_grad()
    def score_window(self, query: str, candidates: Sequence[Any]) -> torch.Tensor:
        """First-token logits of the labels, one forward pass. Text candidates, or images with a processor."""
        n = len(candidates)
        if not 1 <= n <= self.window:
            raise ValueError(f"a window holds 1..{self.window} candidates, got {n}")
        if self.processor is not None:
            inputs = build_vlm_inputs(self.processor, query, candidates)
        else:
            if not all(isinstance(c, str) for c in candidates):
                raise TypeError("text candidates must be strings (images need a processor)")
            inputs = self.text_inputs(query, candidates)
        logits = self.model(**inputs).logits[0, -1]
        self.n_forwards += 1
        scores = logits[self.label_ids[:n]].float()
        if not torch.isfinite(scores).all():
            raise ValueError("the model produced non-finite label logits")
        return scores

    def rerank(self, query: str, candidates: Sequence[Any]) -> tuple[list[int], list[float] | None]:
        """A permutation of range(len(candidates)), best first; the scores when one window sufficed."""
        return listwise_rerank(lambda idx: self.score_window(query, [candidates[i] for i in idx]),
                               len(candidates), self.window, self.stride)


def listwise_rerank(score: Callable[[list[int]], torch.Tensor], n: int, window: int,
                    stride: int) -> tuple[list[int], list[float] | None]:
    """Rerank n candidates with ``score(indices)`` (one listwise forward: a score per index, in
    order): one call when n ≤ window, else RankGPT's windows sliding from the tail to the head by
    ``stride``, each window's order written back before the next. Returns (permutation, best first;
    the scores when one window sufficed). Any listwise scorer uses it, e.g. a toy model in training."""
    if n == 0:
        raise ValueError("no candidates to rerank")
    if n <= window:
        s = score(list(range(n)))
        return [int(i) for i in torch.argsort(s, descending=True, stable=True)], s.tolist()
    order = list(range(n))
    end = n
    while True:
        start = max(0, end - window)
        idx = order[start:end]
        s = score(idx)
        order[start:end] = [idx[int(j)] for j in torch.argsort(s, descending=True, stable=True)]
        if start == 0:
            break
        end -= stride
    return order, None


def n_windows(n: int, window: int, stride: int) -> int:
    """Forward passes :meth:`ListwiseReranker.rerank` makes for n candidates."""
    return 1 if n <= window else 1 + math.ceil((n - window) / stride)


# ---------------------------------------------------------------------------------- QI-EI


def qi_ei_scores(text: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
    """s_p = max_t cos(text_t, patch_p) for text (T, D) and patches (N, D)."""
    if text.ndim != 2 or patches.ndim != 2 or text.shape[1] != patches.shape[1]:
        raise ValueError(f"text must be (T, D) and patches (N, D) with the same D, got {tuple(text.shape)} "
                         f"and {tuple(patches.shape)}")
    if text.shape[0] == 0 or patches.shape[0] == 0:
        raise ValueError("need at least one text token and one patch")
    return (F.normalize(text, dim=-1) @ F.normalize(patches, dim=-1).T).max(0).values


def n_kept(n: int, rho: float, rounding: Rounding = "round") -> int:
    if not 0 < rho <= 1:
        raise ValueError(f"keep ratio rho must be in (0, 1], got {rho}")
    k = round(rho * n) if rounding == "round" else math.ceil(rho * n - 1e-12)
    return max(1, min(n, int(k)))


def qi_ei_prune(text: torch.Tensor, patches: torch.Tensor, rho: float,
                rounding: Rounding = "round") -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the best max(1, round(ρN)) patches by s_p, in spatial order: (kept patches, sorted indices)."""
    s = qi_ei_scores(text, patches)
    k = n_kept(patches.shape[0], rho, rounding)
    idx = torch.sort(torch.topk(s, k).indices).values
    return patches[idx], idx


# ---------------------------------------------------------------------------------- losses


def soft_targets(n: int, teacher_order: Sequence[int], relevant: Sequence[int], decay: float = 0.5) -> torch.Tensor:
    """Target distribution over n candidates: GT first, then teacher order, weight decay^position."""
    if not 0 < decay < 1:
        raise ValueError(f"decay must be in (0, 1), got {decay}")
    for name, seq in (("teacher_order", teacher_order), ("relevant", relevant)):
        bad = [i for i in seq if not 0 <= int(i) < n]
        if bad:
            raise ValueError(f"{name} holds indices outside 0..{n - 1}: {bad}")
    gt = list(dict.fromkeys(int(i) for i in relevant))
    rest = [int(i) for i in dict.fromkeys(teacher_order) if int(i) not in set(gt)]
    order = gt + rest
    w = torch.zeros(n, dtype=torch.float64)
    for pos, i in enumerate(order):
        w[i] = decay ** pos
    if w.sum() == 0:
        raise ValueError("neither relevant candidates nor a teacher order: no target")
    return w / w.sum()


def soft_ranking_loss(scores: torch.Tensor, teacher_order: Sequence[int], relevant: Sequence[int],
                      decay: float = 0.5) -> torch.Tensor:
    """L = −Σ target · log softmax(scores) for one list of scores (N,)."""
    if scores.ndim != 1:
        raise ValueError(f"scores must be (N,), got shape {tuple(scores.shape)}")
    t = soft_targets(scores.shape[0], teacher_order, relevant, decay).to(scores.dtype)
    return -(t * F.log_softmax(scores, dim=0)).sum()


def ranknet_loss(scores: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """Mean over pairs with rel_i > rel_j of BCEWithLogits(s_i − s_j, 1) = softplus(s_j − s_i)."""
    if scores.shape != relevance.shape or scores.ndim != 1:
        raise ValueError(f"scores and relevance must both be (N,), got {tuple(scores.shape)} and "
                         f"{tuple(relevance.shape)}")
    diff_true = relevance[:, None] - relevance[None, :]
    mask = diff_true > 0
    if not bool(mask.any()):
        raise ValueError("no pair with different relevance: RankNet is undefined")
    d = (scores[:, None] - scores[None, :])[mask]
    return F.binary_cross_entropy_with_logits(d, torch.ones_like(d))


# ---------------------------------------------------------------------------------- evaluation


def recall_at_k(ranking: Sequence[int], relevant: Sequence[int], k: int) -> float:
    rel = set(relevant)
    if not rel:
        raise ValueError("recall needs at least one relevant candidate")
    return len(rel & set(ranking[:k])) / len(rel)


def ndcg_at_k(ranking: Sequence[int], relevant: Sequence[int], k: int) -> float:
    """Binary-gain nDCG@k: Σ_{i<k, r_i relevant} 1/log2(i+2) over the ideal."""
    rel = set(relevant)
    if not rel:
        raise ValueError("nDCG needs at least one relevant candidate")
    dcg = sum(1 / math.log2(i + 2) for i, c in enumerate(ranking[:k]) if c in rel)
    ideal = sum(1 / math.log2(i + 2) for i in range(min(k, len(rel))))
    return dcg / ideal


class RankingExample(BaseModel):
    query: str
    candidates: list[str] = Field(min_length=1)
    relevant: list[int] = Field(min_length=1)


def load_ranking_set(path: str | Path) -> list[RankingExample]:
    """JSONL, one ``{"query", "candidates", "relevant"}`` per line (candidates in first-stage order)."""
    from closedloop.artifacts import resolve_array_path

    p = resolve_array_path(str(path), "ranking_set")  # inside the working root, or refused
    if not p.is_file():
        raise ArtifactError(f"ranking set not found: {path}")
    out = []
    for no, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            ex = RankingExample.model_validate_json(line)
        except Exception as e:
            raise ValueError(f"{p}:{no}: not a ranking example: {e}") from None
        if any(not 0 <= i < len(ex.candidates) for i in ex.relevant):
            raise ValueError(f"{p}:{no}: relevant indices {ex.relevant} outside 0..{len(ex.candidates) - 1}")
        out.append(ex)
    if not out:
        raise ValueError(f"{p}: no examples")
    return out


def evaluate_ranking_set(reranker: ListwiseReranker, examples: Sequence[RankingExample],
                         ks: Sequence[int] = (1, 3, 5), *, base_dir: str | Path | None = None) -> dict[str, Any]:
    """Macro recall@k and nDCG@k for the first-stage order and the reranked order, plus cost.

    With a VLM reranker the candidates are page image files (relative paths from ``base_dir``,
    the ranking set's folder when the tool loads it)."""
    first: dict[str, list[float]] = {f"{m}@{k}": [] for m in ("recall", "ndcg") for k in ks}
    rer: dict[str, list[float]] = {key: [] for key in first}
    reranker.n_forwards = 0
    t0 = time.perf_counter()
    for ex in examples:
        cands: Sequence[Any] = ex.candidates
        if reranker.reads_images:
            cands = _load_pages([str(Path(base_dir or ".") / c) for c in ex.candidates])
        perm, _ = reranker.rerank(ex.query, cands)
        for k in ks:
            for name, r in ((first, list(range(len(ex.candidates)))), (rer, perm)):
                name[f"recall@{k}"].append(recall_at_k(r, ex.relevant, k))
                name[f"ndcg@{k}"].append(ndcg_at_k(r, ex.relevant, k))
    secs = time.perf_counter() - t0
    return {"first_stage": {k: float(np.mean(v)) for k, v in first.items()},
            "reranked": {k: float(np.mean(v)) for k, v in rer.items()},
            "n_queries": len(examples), "n_forwards": reranker.n_forwards,
            "seconds_per_window": secs / max(1, reranker.n_forwards)}


# ---------------------------------------------------------------------------------- tools


class RerankReport(BaseModel):
    permutation: list[int]
    scores: list[float] | None
    n_forwards: int


Window = Annotated[int, Field(ge=1, le=26)]


def _load_pages(paths: Sequence[str]) -> list[Any]:
    """Page images from files, RGB; a clear error naming the first one that cannot be read."""
    from PIL import Image, UnidentifiedImageError

    from closedloop.artifacts import resolve_array_path

    pages = []
    for p in paths:
        resolve_array_path(p, "page image")  # inside the working root, or refused
        try:
            with Image.open(p) as img:
                pages.append(img.convert("RGB"))
        except (FileNotFoundError, IsADirectoryError):
            raise ArtifactError(f"page image not found: {p}") from None
        except (UnidentifiedImageError, OSError) as e:
            raise ArtifactError(f"page image {p} could not be read: {e}") from None
    return pages


@tool(timeout_s=600)
def ziprerank_rerank(model: ModelArg, query: str, candidates: Annotated[list[str], Field(min_length=1)],
                     window: Window = 20, stride: Annotated[int, Field(ge=1)] = 10) -> RerankReport:
    """Listwise rerank with one forward per window (label first-token logits).

    Args:
        model: hf:<checkpoint directory inside the working root>: a causal LM (text candidates) or a vision-language model with its processor (candidates are page image files).
        query: The search query.
        candidates: Candidate passages in first-stage order (texts, or image file paths for a VLM).
        window: Candidates per forward pass (≤ 26, letters A–Z; the paper uses 20).
        stride: Step of the sliding window when there are more candidates than the window.
    """
    rr = ListwiseReranker.from_spec(model, window=window, stride=stride)
    perm, scores = rr.rerank(query, _load_pages(candidates) if rr.reads_images else candidates)
    return RerankReport(permutation=perm, scores=scores, n_forwards=rr.n_forwards)


@tool(timeout_s=1800)
def ziprerank_evaluate(model: ModelArg, ranking_set: str, ks: list[Annotated[int, Field(ge=1)]] = [1, 3, 5],  # noqa: B006
                       window: Window = 20, stride: Annotated[int, Field(ge=1)] = 10) -> dict:
    """Recall@k and nDCG@k of the first-stage order and of the listwise rerank on a local ranking set.

    Args:
        model: hf:<checkpoint directory inside the working root> of a causal LM, or of a VLM with its processor.
        ranking_set: JSONL file, one {"query", "candidates", "relevant"} per line (for a VLM, candidates are image files relative to it).
        ks: Cut-offs k.
        window: Candidates per forward pass (≤ 26).
        stride: Sliding-window step for longer lists.
    """
    examples = load_ranking_set(ranking_set)
    rr = ListwiseReranker.from_spec(model, window=window, stride=stride)
    return evaluate_ranking_set(rr, examples, ks, base_dir=Path(ranking_set).expanduser().parent)


class PruneReport(BaseModel):
    kept_indices: list[int]
    n_patches: int
    n_kept: int
    scores: list[float]


@tool
def ziprerank_prune_patches(text_embeddings: ArrayInput, patch_embeddings: ArrayInput,
                            rho: Annotated[float, Field(gt=0, le=1)] = 0.5,
                            rounding: Rounding = "round") -> PruneReport:
    """QI-EI: keep the patches most similar to any query token (max cosine), in spatial order.

    Args:
        text_embeddings: (T, D) query-token embeddings: .npy/.npz/.safetensors path or inline list.
        patch_embeddings: (N, D) visual patch embeddings of one page.
        rho: Keep ratio ρ in (0, 1]; ρ = 1 keeps all.
        rounding: 'round' keeps max(1, round(ρN)) as the official code; 'ceil' keeps ⌈ρN⌉.
    """
    t = torch.as_tensor(load_array(text_embeddings, name="text_embeddings"), dtype=torch.float64)
    p = torch.as_tensor(load_array(patch_embeddings, name="patch_embeddings"), dtype=torch.float64)
    s = qi_ei_scores(t, p)
    _, idx = qi_ei_prune(t, p, rho, rounding)
    return PruneReport(kept_indices=idx.tolist(), n_patches=p.shape[0], n_kept=len(idx), scores=s.tolist())


class LossReport(BaseModel):
    soft_targets: list[float]
    soft_ranking_loss: float
    ranknet_loss: float | None


@tool
def ziprerank_losses(scores: Annotated[list[float], Field(min_length=2)], relevant: Annotated[list[int], Field(min_length=1)],
                     teacher_order: list[int] | None = None,
                     decay: Annotated[float, Field(gt=0, lt=1)] = 0.5) -> LossReport:
    """Soft-ranking cross-entropy (GT first, teacher order, decay^position) and RankNet for one list.

    Args:
        scores: Model scores of the N candidates.
        relevant: Indices of the ground-truth candidates.
        teacher_order: Teacher ranking of the candidates (indices, best first); defaults to index order.
        decay: Position decay of the soft targets.
    """
    s = torch.tensor(scores, dtype=torch.float64)
    if not torch.isfinite(s).all():
        raise ValueError("scores contain NaN or infinite values")
    order = teacher_order if teacher_order is not None else list(range(len(scores)))
    t = soft_targets(len(scores), order, relevant, decay)
    rel = torch.zeros_like(s)
    rel[list(relevant)] = 1.0
    rn = float(ranknet_loss(s, rel)) if 0 < len(set(relevant)) < len(scores) else None
    return LossReport(soft_targets=t.tolist(), soft_ranking_loss=float(soft_ranking_loss(s, order, relevant, decay)),
                      ranknet_loss=rn)


TOOLS: list[Tool] = [ziprerank_rerank, ziprerank_evaluate, ziprerank_prune_patches, ziprerank_losses]
