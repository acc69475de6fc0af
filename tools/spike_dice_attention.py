"""Spike Dice Attention (SDA): set similarity between binary spike queries and keys.

Lim, Jeong, Kim, "Rethinking Attention in Spiking Transformers: Overcoming Density Bias with
Set Similarity" (DiceFormer), ICML 2026, OpenReview 8clCPAImE3. No official code; the
formulas follow a secondary digest of the paper (see research/papers.md §16)::

    I(q, k) = q · k            (co-firing count)      C(q) = Σ_d q_d   (firing count)
    SDS(q, k) = 2 I(q, k) / (C(q) + C(k) + ε),  ε = 1e-6               (Dice coefficient)
    Lin-SDS(q, k) = I(q, k) − λ (C(q) + C(k)),  λ ≥ 0 learnable        (division-free)

Why: a dot product q·k grows with how often q and k fire, so dense tokens dominate attention
whatever their content ("density bias"); Dice normalises the overlap by the firing counts.

Properties (for binary q, k): SDS ∈ [0, 1); SDS(q, k) = SDS(k, q); SDS(q, q) = 1 − O(ε) for any
non-zero q, whatever its density, whereas q·q = C(q). Lin-SDS needs only additions and
multiplications. Since C(q) + C(k) > 0, SDS ≥ θ ⟺ Lin-SDS with λ = θ/2 is ≥ θε/2 ≈ 0, so
Lin-SDA with λ = θ/2 and threshold 0 selects the same pairs as SDA with threshold θ (up to ties).

Shapes: q (…, N, D), k (…, M, D), v (…, M, Dv) binary spikes, usually (B, H, N, D) or with a
leading time axis (T, B, H, N, D); scores (…, N, M); attention output (…, N, Dv). The score
map is binarised by a spiking neuron and applied to V. The digest says "by Hadamard product";
with a full (N, M) map we read that as the Spikformer-style product SN(S) @ V (an assumption).

Spiking neurons fire by a Heaviside step in the forward pass and pass a surrogate derivative
(sigmoid: α σ(αx)(1 − σ(αx)); atan: α / (2 (1 + (π α x / 2)²))) in the backward pass. The
paper uses PLIF neurons (learnable τ), V_th = 1, sigmoid surrogate with α = 4, T = 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, Field
from scipy.stats import rankdata
from torch import nn

from closedloop.artifacts import ArrayInput, ArrayRef, array_output, load_array
from closedloop.tool import Tool, tool

__all__ = [
    "SurrogateSpike", "spike", "LIFNeuron", "spike_dice_scores", "lin_dice_scores", "dot_product_scores",
    "SpikingAttention", "SpikePair", "random_spikes", "density_correlation", "relevance_auc", "TOOLS",
]

Surrogate = Literal["sigmoid", "atan"]
ScoreKind = Literal["sda", "lin_sda", "dot"]


class SurrogateSpike(torch.autograd.Function):
    """Heaviside forward (x ≥ 0 fires), smooth surrogate derivative backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float, kind: str) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.alpha, ctx.kind = alpha, kind
        return (x >= 0).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        a = ctx.alpha
        if ctx.kind == "sigmoid":
            s = torch.sigmoid(a * x)
            d = a * s * (1 - s)
        else:
            d = a / (2 * (1 + (math.pi / 2 * a * x) ** 2))
        return grad_out * d, None, None


def spike(x: torch.Tensor, surrogate: Surrogate = "sigmoid", alpha: float = 4.0) -> torch.Tensor:
    if surrogate not in ("sigmoid", "atan"):
        raise ValueError(f"surrogate must be 'sigmoid' or 'atan', got {surrogate!r}")
    if not alpha > 0:
        raise ValueError(f"surrogate sharpness alpha must be positive, got {alpha}")
    return SurrogateSpike.apply(x, alpha, surrogate)


class LIFNeuron(nn.Module):
    """Multi-step (P)LIF neuron over a leading time axis, hard reset.

    h_t = v_{t−1} + (x_t − (v_{t−1} − v_reset)) / τ;  s_t = Θ(h_t − V_th);  v_t = s_t v_reset + (1 − s_t) h_t.
    With ``learnable_tau`` (PLIF) 1/τ = sigmoid(w), so τ stays above 1.
    """

    def __init__(self, tau: float = 2.0, v_threshold: float = 1.0, v_reset: float = 0.0,
                 learnable_tau: bool = False, surrogate: Surrogate = "sigmoid", alpha: float = 4.0) -> None:
        super().__init__()
        if not tau > 1.0:
            raise ValueError(f"tau must be > 1, got {tau}")
        w = -math.log(tau - 1.0)  # sigmoid(w) = 1/tau
        self.w = nn.Parameter(torch.tensor(w), requires_grad=learnable_tau)
        self.v_threshold, self.v_reset = v_threshold, v_reset
        self.surrogate, self.alpha = surrogate, alpha

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        if x_seq.ndim < 2:
            raise ValueError(f"LIFNeuron wants (T, ...) input, got shape {tuple(x_seq.shape)}")
        inv_tau = torch.sigmoid(self.w).to(x_seq.dtype)
        v = torch.full_like(x_seq[0], self.v_reset)
        out = []
        for x in x_seq:
            h = v + (x - (v - self.v_reset)) * inv_tau
            s = spike(h - self.v_threshold, self.surrogate, self.alpha)
            v = s * self.v_reset + (1 - s) * h
            out.append(s)
        return torch.stack(out)


# ---------------------------------------------------------------------------------- scores


def _counts(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k need the same feature size, got {q.shape[-1]} and {k.shape[-1]}")
    overlap = q @ k.transpose(-1, -2)
    density = q.sum(-1).unsqueeze(-1) + k.sum(-1).unsqueeze(-2)  # C(q_i) + C(k_j), (…, N, M)
    return overlap, density


def spike_dice_scores(q: torch.Tensor, k: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """SDS(q_i, k_j) = 2 q_i·k_j / (C(q_i) + C(k_j) + ε) for every query/key pair."""
    overlap, density = _counts(q, k)
    return 2 * overlap / (density + eps)


def lin_dice_scores(q: torch.Tensor, k: torch.Tensor, lam: torch.Tensor | float) -> torch.Tensor:
    """Lin-SDS = q_i·k_j − λ (C(q_i) + C(k_j)): adds and multiplies only."""
    overlap, density = _counts(q, k)
    return overlap - lam * density


def dot_product_scores(q: torch.Tensor, k: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Spikformer-style spiking self-attention scores: scale · q_i·k_j (no softmax)."""
    return scale * (q @ k.transpose(-1, -2))


class SpikingAttention(nn.Module):
    """Spiking attention with Dice, linear Dice or dot-product scores.

    The score map goes through a spiking neuron (fires where score ≥ threshold) when
    ``binarize`` is set, then multiplies V. Defaults: SDA threshold ½; Lin-SDA λ = ¼ and
    threshold 0 (the same pairs as SDA at ½); dot product unbinarised with scale 1/8 as in
    Spikformer, whose output spiking neuron then sees the integer products.
    """

    def __init__(self, kind: ScoreKind = "sda", *, threshold: float | None = None, lam: float = 0.25,
                 learnable_lambda: bool = True, scale: float = 0.125, binarize: bool | None = None,
                 surrogate: Surrogate = "sigmoid", alpha: float = 4.0, eps: float = 1e-6) -> None:
        super().__init__()
        if kind not in ("sda", "lin_sda", "dot"):
            raise ValueError(f"kind must be 'sda', 'lin_sda' or 'dot', got {kind!r}")
        if lam < 0:
            raise ValueError(f"lambda must be ≥ 0, got {lam}")
        self.kind = kind
        self.threshold = threshold if threshold is not None else {"sda": 0.5, "lin_sda": 0.0, "dot": 0.0}[kind]
        self.binarize = binarize if binarize is not None else kind != "dot"
        self.lam = nn.Parameter(torch.tensor(float(lam)), requires_grad=learnable_lambda)
        self.scale, self.surrogate, self.alpha, self.eps = scale, surrogate, alpha, eps

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if self.kind == "sda":
            return spike_dice_scores(q, k, self.eps)
        if self.kind == "lin_sda":
            return lin_dice_scores(q, k, self.lam.clamp_min(0).to(q.dtype))  # λ ≥ 0 without a division
        return dot_product_scores(q, k, self.scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[-2] != v.shape[-2]:
            raise ValueError(f"k and v need the same number of tokens, got {k.shape[-2]} and {v.shape[-2]}")
        s = self.scores(q, k)
        if self.binarize:
            s = spike(s - self.threshold, self.surrogate, self.alpha)
        return s @ v


# ---------------------------------------------------------------------------------- statistics


@dataclass
class SpikePair:
    q: torch.Tensor  # (B, H, N, D) binary
    k: torch.Tensor  # (B, H, M, D) binary
    q_group: torch.Tensor | None = None  # (B, H, N) prototype index, "prototype" structure only
    k_group: torch.Tensor | None = None


def random_spikes(batch: int, heads: int, tokens: int, dim: int, *, rate_low: float = 0.05, rate_high: float = 0.5,
                  structure: Literal["independent", "prototype"] = "independent", n_prototypes: int = 8,
                  keep: float = 0.9, noise: float = 0.02, seed: int = 0,
                  dtype: torch.dtype = torch.float64) -> SpikePair:
    """Binary q, k with firing rates that vary per token (uniform in [rate_low, rate_high]).

    ``independent``: every token fires Bernoulli(rate) on its own, so any score is content-free.
    ``prototype``: tokens are noisy copies (keep a spike with ``keep``, add ``noise``) of one of
    ``n_prototypes`` patterns, each with its own rate; same prototype = relevant pair.
    """
    if not 0.0 < rate_low <= rate_high <= 1.0:
        raise ValueError(f"need 0 < rate_low ≤ rate_high ≤ 1, got {rate_low}, {rate_high}")
    if min(batch, heads, tokens, dim, n_prototypes) < 1:
        raise ValueError("sizes and n_prototypes must be positive")
    if not (0 <= keep <= 1 and 0 <= noise <= 1):
        raise ValueError("keep and noise are probabilities in [0, 1]")
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, tokens, dim)

    def u(*s: int) -> torch.Tensor:
        return torch.rand(*s, generator=g, dtype=torch.float64)

    if structure == "independent":
        rq = rate_low + (rate_high - rate_low) * u(batch, heads, tokens, 1)
        rk = rate_low + (rate_high - rate_low) * u(batch, heads, tokens, 1)
        return SpikePair((u(*shape) < rq).to(dtype), (u(*shape) < rk).to(dtype))
    if structure != "prototype":
        raise ValueError(f"structure must be 'independent' or 'prototype', got {structure!r}")
    rates = rate_low + (rate_high - rate_low) * u(batch, heads, n_prototypes, 1)
    protos = (u(batch, heads, n_prototypes, dim) < rates).to(torch.float64)

    def draw() -> tuple[torch.Tensor, torch.Tensor]:
        grp = torch.randint(0, n_prototypes, (batch, heads, tokens), generator=g)
        base = torch.gather(protos, 2, grp[..., None].expand(*shape))
        s = torch.clamp(base * (u(*shape) < keep) + (u(*shape) < noise), 0, 1)
        return s.to(dtype), grp

    (q, gq), (k, gk) = draw(), draw()
    return SpikePair(q, k, gq, gk)


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    denom = float(a.norm() * b.norm())
    return float(a @ b) / denom if denom > 0 else float("nan")


def density_correlation(scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> float:
    """Pearson r between every pair's score and its joint firing count C(q_i) + C(k_j)."""
    return _pearson(scores, _counts(q, k)[1])


def relevance_auc(scores: torch.Tensor, q_group: torch.Tensor, k_group: torch.Tensor) -> float:
    """P(score of a same-prototype pair > score of a different-prototype pair), ties count ½."""
    same = (q_group.unsqueeze(-1) == k_group.unsqueeze(-2)).flatten().numpy()
    s = scores.flatten().double().numpy()
    pos, neg = s[same], s[~same]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    # Mann–Whitney U via average ranks; exact, no sampling.
    ranks = rankdata(np.concatenate([pos, neg]))
    u_stat = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u_stat / (len(pos) * len(neg)))


# ---------------------------------------------------------------------------------- tools

Size = Annotated[int, Field(ge=1, le=4096)]
Rate = Annotated[float, Field(gt=0.0, le=1.0)]


class ScoreStats(BaseModel):
    density_correlation: float = Field(description="Pearson r(score, C(q)+C(k)) over all pairs")
    mean_score: float
    self_score_spread: float | None = Field(None, description="max − min of score(q, q) over non-silent queries")
    relevance_auc: float | None = None


class DensityBiasReport(BaseModel):
    shape_q: list[int]
    shape_k: list[int]
    source: str
    mean_rate_q: float
    mean_rate_k: float
    lin_lambda: float
    sda: ScoreStats
    lin_sda: ScoreStats
    dot: ScoreStats


def _load_spikes(value: ArrayInput, name: str) -> torch.Tensor:
    arr = np.asarray(load_array(value, name=name))
    if arr.ndim == 2:
        arr = arr[None, None]
    if arr.ndim != 4:
        raise ValueError(f"{name} must have shape (B, H, N, D) or (N, D), got {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isin(arr, (0, 1)).all():
        raise ValueError(f"{name} must be binary spikes (only 0 and 1)")
    return torch.from_numpy(arr.astype(np.float64))


def _stats(scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, self_scores: torch.Tensor | None,
           pair: SpikePair | None) -> ScoreStats:
    spread = None
    if self_scores is not None:
        alive = q.sum(-1) > 0
        diag = torch.diagonal(self_scores, dim1=-2, dim2=-1)[alive]
        spread = float(diag.max() - diag.min()) if diag.numel() else None
    auc = None
    if pair is not None and pair.q_group is not None and pair.k_group is not None:
        auc = relevance_auc(scores, pair.q_group, pair.k_group)
    return ScoreStats(density_correlation=density_correlation(scores, q, k), mean_score=float(scores.mean()),
                      self_score_spread=spread, relevance_auc=auc)


def _density_bytes(batch: int = 2, heads: int = 4, tokens: int = 64, dim: int = 64, **_: object) -> float:
    """Spikes (B, H, N, D) and three (B, H, N, N) score tensors, float32, a few times over."""
    return 4.0 * 4 * batch * heads * tokens * (dim + 3 * tokens)


@tool(timeout_s=120, isolation="process", estimate_bytes=_density_bytes)
def spike_attention_density_bias(batch: Size = 2, heads: Size = 4, tokens: Size = 64, dim: Size = 64,
                                 rate_low: Rate = 0.05, rate_high: Rate = 0.5,
                                 structure: Literal["independent", "prototype"] = "independent",
                                 n_prototypes: Size = 8, seed: int = 0,
                                 lin_lambda: Annotated[float, Field(ge=0.0)] = 0.25,
                                 queries: ArrayInput | None = None, keys: ArrayInput | None = None) -> DensityBiasReport:
    """How much spiking attention scores follow firing density: SDA and Lin-SDA vs dot product.

    Reports, for each score, Pearson r with C(q)+C(k), the spread of self-scores score(q, q)
    across densities (0 for SDA), and with structure='prototype' the AUC for telling
    same-prototype pairs from others. Give queries (and keys) to score your own spikes.

    Args:
        batch: B for generated spikes.
        heads: H for generated spikes.
        tokens: N for generated spikes.
        dim: D, features per head, for generated spikes.
        rate_low: Lowest per-token firing rate.
        rate_high: Highest per-token firing rate.
        structure: 'independent' (content-free) or 'prototype' (noisy copies of shared patterns).
        n_prototypes: Number of patterns for structure='prototype'.
        seed: Seed for the generated spikes.
        lin_lambda: λ of Lin-SDA (≥ 0); ¼ matches SDA thresholded at ½.
        queries: Optional binary spikes (B, H, N, D) or (N, D): .npy/.npz/.safetensors path or inline list.
        keys: Optional binary spikes like queries; defaults to queries (self-attention).
    """
    if rate_low > rate_high:
        raise ValueError(f"rate_low ({rate_low}) must not exceed rate_high ({rate_high})")
    pair: SpikePair | None = None
    if queries is None:
        if keys is not None:
            raise ValueError("keys given without queries")
        pair = random_spikes(batch, heads, tokens, dim, rate_low=rate_low, rate_high=rate_high, structure=structure,
                             n_prototypes=n_prototypes, seed=seed)
        q, k, source = pair.q, pair.k, f"random:{structure}"
    else:
        q = _load_spikes(queries, "queries")
        k = _load_spikes(keys, "keys") if keys is not None else q
        if k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1]:
            raise ValueError(f"queries {tuple(q.shape)} and keys {tuple(k.shape)} must share B, H and D")
        source = "artifact"
    out = {}
    for kind, fn in (("sda", lambda a, b: spike_dice_scores(a, b)),
                     ("lin_sda", lambda a, b: lin_dice_scores(a, b, lin_lambda)),
                     ("dot", lambda a, b: dot_product_scores(a, b))):
        out[kind] = _stats(fn(q, k), q, k, fn(q, q), pair)
    return DensityBiasReport(shape_q=list(q.shape), shape_k=list(k.shape), source=source,
                             mean_rate_q=float(q.mean()), mean_rate_k=float(k.mean()), lin_lambda=lin_lambda, **out)


class ScoresReport(BaseModel):
    kind: str
    shape: list[int]
    scores: ArrayRef | list = Field(description="the (…, N, M) score map: inline if small, else an .npy artifact")
    min: float
    max: float


@tool(timeout_s=120)
def spike_attention_scores(queries: ArrayInput, keys: ArrayInput | None = None, kind: ScoreKind = "sda",
                           lin_lambda: Annotated[float, Field(ge=0.0)] = 0.25,
                           scale: Annotated[float, Field(gt=0.0)] = 1.0) -> ScoresReport:
    """Score map between binary spike queries and keys: Dice (SDA), linear Dice or dot product.

    Args:
        queries: Binary spikes (B, H, N, D) or (N, D): .npy/.npz/.safetensors path or inline list.
        keys: Binary spikes like queries; defaults to queries (self-attention).
        kind: 'sda', 'lin_sda' or 'dot'.
        lin_lambda: λ of Lin-SDA (≥ 0).
        scale: Multiplier of the dot-product scores.
    """
    q = _load_spikes(queries, "queries")
    k = _load_spikes(keys, "keys") if keys is not None else q
    if k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"queries {tuple(q.shape)} and keys {tuple(k.shape)} must share B, H and D")
    s = {"sda": lambda: spike_dice_scores(q, k), "lin_sda": lambda: lin_dice_scores(q, k, lin_lambda),
         "dot": lambda: dot_product_scores(q, k, scale)}[kind]()
    return ScoresReport(kind=kind, shape=list(s.shape), scores=array_output(s.numpy(), prefix=f"{kind}-scores"),
                        min=float(s.min()), max=float(s.max()))


TOOLS: list[Tool] = [spike_attention_density_bias, spike_attention_scores]
