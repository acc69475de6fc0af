"""The trainers' losses, each a pure function of tensors you can read on one screen.

Conventions (shared by every function here):

- Tensors are ``[B, T]`` and aligned with ``input_ids``: column ``t`` is about token ``t``.
  ``logps[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``; column 0 has no prediction and is 0.
  This is the layout of :class:`closedloop.messages.TokenView` (``loss_mask``, ``logprobs``,
  ``turn_index``), so a multi-turn episode is trained as one sequence with its own mask.
- ``mask`` is the loss mask: 1 on tokens the policy generated and is trained on, 0 on system, user,
  tool, template and padding tokens. A token with mask 0 contributes exactly nothing (no gradient).
- Nothing here divides by gradient-accumulation steps or all-reduces: the trainer owns that, so the
  equations below are the whole story.

The GRPO and SFT losses mirror TRL 1.16 (``trl/trainer/grpo_trainer.py::GRPOTrainer._compute_loss``,
``trl/trainer/sft_trainer.py::SFTTrainer.compute_loss``, ``trl/trainer/utils.py``); the golden tests
in ``tests/trainers/test_losses.py`` check equality on identical tensors.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo")


#: Elements of one chunk of logits in :func:`gather_logps` (64 MB of float32): small batches go in one
#: vectorised call, a large vocabulary times a long sequence is cut so the temporaries stay bounded.
GATHER_CHUNK_ELEMENTS = 1 << 24


def gather_logps(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., index]`` over the last axis (TRL's ``selective_log_softmax``).

    In float32/64, ``x_i - logsumexp(x)`` never materialises the log-softmax; low precision uses
    ``log_softmax`` because logsumexp is unstable in bfloat16. TRL loops one batch row at a time to
    bound memory; here the leading rows go in chunks of :data:`GATHER_CHUNK_ELEMENTS` (the same
    numbers: each row's reduction is the same kernel), so a small batch is one call instead of a
    Python loop whose backward has one node per row."""
    flat, idx = logits.reshape(-1, logits.size(-1)), index.reshape(-1)
    rows = max(1, GATHER_CHUNK_ELEMENTS // max(1, flat.size(-1)))
    parts = []
    for x, i in zip(flat.split(rows), idx.split(rows), strict=True):
        if x.dtype in (torch.float32, torch.float64):
            parts.append(x.gather(-1, i.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1))
        else:
            parts.append(F.log_softmax(x, dim=-1).gather(-1, i.unsqueeze(-1)).squeeze(-1))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(index.shape)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probabilities of ``input_ids`` under ``logits`` (a causal LM's ``[B, T, V]`` output).

    ``logps[:, t] = log_softmax(logits[:, t-1] / temperature)[input_ids[:, t]]`` for ``t >= 1`` and
    ``logps[:, 0] = 0``. Dividing by the sampling temperature makes these the ``tempered`` logprobs
    that ``hf:``/``vllm:`` record (:class:`closedloop.messages.LogprobSpec`), as TRL's GRPO does
    (``selective_log_softmax(logits, ids, temperature)``).
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [B, T, V] and input_ids [B, T]; got {tuple(logits.shape)} and "
                         f"{tuple(input_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    shifted = logits[:, :-1]
    if temperature != 1.0:
        shifted = shifted / temperature
    logps = gather_logps(shifted, input_ids[:, 1:].long())
    return torch.cat([logps.new_zeros(logps.size(0), 1), logps], dim=1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """Shannon entropy (nats) of ``softmax(logits)`` over the last axis, ``H = -Σ_v p_v log p_v``,
    computed ``chunk_size`` rows at a time to bound memory (TRL's ``trl.trainer.utils.entropy_from_logits``).
    Returns ``logits.shape[:-1]``; note ``entropy[:, t]`` is the entropy of the prediction *of* token t+1."""
    flat = logits.reshape(-1, logits.size(-1))
    parts = []
    for chunk in flat.split(chunk_size, dim=0):
        logp = F.log_softmax(chunk, dim=-1)
        parts.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(parts).reshape(logits.shape[:-1])


def _check_mask(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    if x.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but mask has {tuple(mask.shape)}")


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, *,
             num_items_in_batch: int | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean token cross-entropy over the tokens the assistant produced.

    ``loss = -Σ_{b,t≥1} m[b,t] · logp[b,t] / N`` with ``logp = token_logprobs(logits, input_ids)``,
    ``m = loss_mask`` and ``N = num_items_in_batch`` if given else ``Σ_{t≥1} m`` (at least 1). This is
    TRL's ``SFTTrainer.compute_loss`` with ``labels = input_ids`` set to -100 where the assistant /
    completion mask is 0 (``-log_probs.sum() / num_tokens``; HF shifts labels by one, so a mask on
    token 0 cannot be trained and is ignored). Pass ``num_items_in_batch`` (the trained tokens of the
    whole optimisation step) when accumulating gradients, as ``transformers.Trainer`` does.

    Metrics (detached): ``num_tokens``, ``mean_token_accuracy`` (argmax hits), ``entropy`` (mean, nats).
    """
    _check_mask("input_ids", input_ids, loss_mask)
    mask = loss_mask[:, 1:].to(logits.dtype)
    logps = token_logprobs(logits, input_ids)[:, 1:]
    count = mask.sum()
    denom = count if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=logits.dtype,
                                                                     device=logits.device)
    loss = -(logps * mask).sum() / denom.clamp(min=1)
    with torch.no_grad():
        sel = loss_mask[:, 1:].bool()
        pred = logits[:, :-1][sel]
        metrics = {
            "num_tokens": count.detach(),
            "mean_token_accuracy": (pred.argmax(-1) == input_ids[:, 1:][sel]).float().mean()
            if pred.numel() else logits.new_zeros(()),
            "entropy": entropy_from_logits(pred).mean() if pred.numel() else logits.new_zeros(()),
        }
    return loss, metrics


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π_θ ‖ π_ref) (Schulman's "k3"), as TRL's GRPO computes it:
    ``exp(ref − logp) − (ref − logp) − 1`` (always ≥ 0, unbiased for samples drawn from π_θ)."""
    diff = ref_logps - logps
    return torch.exp(diff) - diff - 1


def importance_sampling_weights(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, *,
                                mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                              "sequence_mask"] = "token_truncate",
                                clip_min: float | None = None, clip_max: float | None = 3.0,
                                sampler_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Rollout-engine correction ``w = π_trainer(old) / π_sampler`` (TRL's ``vllm_importance_sampling_correction``).

    ``d = (trainer_logps − sampler_logps) · mask`` with ``d = 0`` where the sampler gave no logprob
    (``sampler_mask`` 0, TokenView's ``logprob_mask``; TRL's NaN case), so such tokens get no
    correction. ``token_*``: ``w = exp(d)`` ``[B, T]``; ``sequence_*``: ``w = exp(Σ_t d)`` ``[B, 1]``.
    ``*_truncate`` clamps ``w`` to ``[clip_min, clip_max]`` (truncated IS); ``*_mask`` sets ``w = 0``
    outside that range. Computed without gradient: ``trainer_logps`` are the old (pre-update) ones.
    """
    _check_mask("trainer_logps", trainer_logps, mask)
    with torch.no_grad():
        diff = (trainer_logps - sampler_logps) * mask
        if sampler_mask is not None:
            diff = diff * sampler_mask
        diff = torch.nan_to_num(diff, nan=0.0)
        if mode.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        w = torch.exp(diff)
        if mode.endswith("truncate"):
            return torch.clamp(w, min=clip_min, max=clip_max)
        if mode.endswith("mask"):
            lo = -float("inf") if clip_min is None else clip_min
            hi = float("inf") if clip_max is None else clip_max
            return w.masked_fill((w < lo) | (w > hi), 0.0)
        raise ValueError(f"unknown importance sampling mode {mode!r}")


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *,
              ref_logps: torch.Tensor | None = None, beta: float = 0.0, epsilon_low: float = 0.2,
              epsilon_high: float = 0.2, loss_type: LossType = "grpo", max_completion_length: int | None = None,
              is_weights: torch.Tensor | None = None, num_items_in_batch: int | torch.Tensor | None = None,
              delta: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss of GRPO and its variants (TRL's ``GRPOTrainer._compute_loss``, token level).

    Per token, with ``r = exp(logp − old)`` (``old = logp.detach()`` when ``old_logps`` is None: one
    pass per rollout batch, where ``r = 1`` but its gradient is the policy gradient) and ``A`` the
    advantage (per sequence ``[B]`` broadcast over tokens, or per token ``[B, T]`` for turn credit)::

        ℓ = −min(r̃·A, clip(r, 1−ε_low, 1+ε_high)·A)    r̃ = min(r, δ) if δ else r   (two-sided clip)
        ℓ ← ℓ · w_IS                                    (is_weights: rollout-engine correction)
        ℓ ← ℓ + β · k3_kl(logp, ref)                    (β > 0 needs ref_logps)

    Aggregation over the mask ``m`` (exactly TRL's, before its division by accumulation steps):
    ``grpo``: ``mean_b(Σ_t ℓm / Σ_t m)``; ``bnpo``: ``Σ ℓm / Σ m``; ``dr_grpo``:
    ``Σ ℓm / (B · max_completion_length)`` (default ``T``); ``dapo``: ``Σ ℓm / num_items_in_batch``
    (default ``Σ m``). TRL's dapo divisor is ``num_items_in_batch / num_processes ·
    grad_accum / steps_per_generation``: pass that number here.

    Metrics (detached, masked means over tokens): ``kl`` (when β > 0), ``clip_ratio/low_mean``
    (r < 1−ε_low with A < 0), ``clip_ratio/high_mean`` (r > 1+ε_high with A > 0),
    ``clip_ratio/region_mean``, ``ratio_mean``, ``advantage_mean``, ``num_tokens``, and ``is_weight_mean``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    _check_mask("logps", logps, mask)
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 needs ref_logps (the reference model's token logprobs)")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    elif advantages.shape != logps.shape:
        raise ValueError(f"advantages must be [B] or [B, T]={tuple(logps.shape)}, got {tuple(advantages.shape)}")
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps

    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token = -torch.min(unclipped * advantages, clipped * advantages)
    if is_weights is not None:
        per_token = per_token * is_weights
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps")
        kl = k3_kl(logps, ref_logps)
        per_token = per_token + beta * kl

    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        length = mask.size(1) if max_completion_length is None else max_completion_length
        loss = (per_token * mask).sum() / (per_token.size(0) * length)
    else:  # dapo
        n = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=logps.dtype,
                                                                          device=logps.device)
        loss = (per_token * mask).sum() / n.clamp(min=1.0)

    with torch.no_grad():
        count = mask.sum()

        def mean(x: torch.Tensor) -> torch.Tensor:
            return (x.expand_as(mask) * mask).sum() / count.clamp(min=1.0)

        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        metrics = {"clip_ratio/low_mean": mean(low.to(mask.dtype)), "clip_ratio/high_mean": mean(high.to(mask.dtype)),
                   "clip_ratio/region_mean": mean((low | high).to(mask.dtype)), "ratio_mean": mean(ratio),
                   "advantage_mean": mean(advantages.to(mask.dtype)), "num_tokens": count}
        if beta != 0.0:
            metrics["kl"] = mean(kl)
        if is_weights is not None:
            metrics["is_weight_mean"] = mean(is_weights.to(mask.dtype))
    return loss, metrics
