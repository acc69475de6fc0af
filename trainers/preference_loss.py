"""Preference losses: DPO (sigmoid, hinge, IPO) and Constrained Preference Optimization (paper 6).

Every function takes per-pair sequence log-probabilities ``[B]`` (sums over the completion's
tokens, as TRL's ``DPOTrainer`` computes them) and returns per-pair losses ``[B]``; the trainer
averages them over the global batch. Notation (paper 6):

    ℓ(y)  = log π(y|x), divided by the completion length when length-normalised
    Δθ    = ℓθ(y_w) − ℓθ(y_l)          the policy's preference for the chosen answer
    Δref  = ℓref(y_w) − ℓref(y_l)      the reference's

DPO (TRL 1.16 ``DPOTrainer._compute_loss``, reverse KL; equality tested in
``tests/trainers/test_preference.py``) with ``z = Δθ − Δref``:

    sigmoid: −log σ(β z)          hinge: max(0, 1 − β z)          ipo: (z̄ − 1/(2β))²

IPO's ``z̄`` always uses length-normalised log-probs (TRL's choice, confirmed by the IPO authors).

**Why constrain.** DPO is margin ranking with target Δref: its loss is below log 2 as soon as
Δθ > Δref, so when the reference prefers the rejected answer (Δref < 0) DPO is "satisfied" by a
policy that still prefers it (Δθ < 0). Constrained Preference Optimization (Yang et al., ICML
2026, code visitworld123/CPO) moves the target up with a margin ``m ≥ 0`` (all on
length-normalised ℓ, as the paper's code):

    cpo:  m = softplus(τ(γ − Δref)) / τ        L = −log σ(βΔθ − βΔref − (β/α)·m)
    easy: m = γ·(1/ℓref(y_w) + 1/ℓref(y_l))    L = −log σ(βΔθ − βΔref − m)
    clip:                                      L = −log σ(β(Δθ − max(0, Δref)))

``cpo``'s margin is a smooth ``max(0, γ − Δref)``: with Δref well below γ, m ≈ γ − Δref and (α = 1)
the logit is ≈ β(Δθ − γ), so the loss stays high until the policy itself prefers y_w by γ,
whatever the reference did; as γ → −∞, m → 0 and it is DPO exactly.
``softplus`` replaces the paper code's ``log(1 + exp(·))`` (same values, no overflow for large
arguments). ``easy`` divides by ℓref, which is undefined at ℓref = 0 (a certain completion).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

DPOLossType = Literal["sigmoid", "hinge", "ipo"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "hinge", "ipo")
ConstrainedVariant = Literal["cpo", "easy", "clip"]
CONSTRAINED_VARIANTS: tuple[str, ...] = ("cpo", "easy", "clip")

__all__ = ["DPOLossType", "DPO_LOSS_TYPES", "ConstrainedVariant", "CONSTRAINED_VARIANTS", "sequence_logps",
           "normalise", "dpo_losses", "constrained_margin", "constrained_preference_losses", "preference_metrics"]


def sequence_logps(token_logps: torch.Tensor, completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_t logp·mask, Σ_t mask) per row: a completion's log-probability and its length.

    ``token_logps`` in the layout of :func:`closedloop.trainers.losses.token_logprobs` (column t is
    about token t, column 0 has no prediction): a mask on token 0 is ignored, as TRL shifts it away.
    """
    if token_logps.shape != completion_mask.shape:
        raise ValueError(f"token_logps {tuple(token_logps.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} differ")
    mask = completion_mask[:, 1:].to(token_logps.dtype)
    return (token_logps[:, 1:] * mask).sum(-1), mask.sum(-1)


def normalise(logps: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """``logps / max(lengths, 1)``: the paper's ℓ(y) (and TRL's per-token average for IPO)."""
    if lengths is None:
        raise ValueError("length normalisation needs the completion lengths")
    return logps / lengths.to(logps.dtype).clamp(min=1.0)


def dpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
               ref_rejected_logps: torch.Tensor, *, beta: float = 0.1, loss_type: DPOLossType = "sigmoid",
               chosen_lengths: torch.Tensor | None = None, rejected_lengths: torch.Tensor | None = None,
               length_normalize: bool = False) -> torch.Tensor:
    """Per-pair DPO losses ``[B]`` (module docstring). ``length_normalize`` divides every log-prob
    by its completion length first (TRL's ``sigmoid_norm`` for sigmoid); IPO always does."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if length_normalize or loss_type == "ipo":
        chosen_logps, ref_chosen_logps = normalise(chosen_logps, chosen_lengths), normalise(ref_chosen_logps,
                                                                                             chosen_lengths)
        rejected_logps, ref_rejected_logps = normalise(rejected_logps, rejected_lengths), normalise(
            ref_rejected_logps, rejected_lengths)
    z = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * z)
    if loss_type == "hinge":
        return torch.relu(1 - beta * z)
    return (z - 1 / (2 * beta)) ** 2


def constrained_margin(ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, *, variant: ConstrainedVariant,
                       gamma: float, tau: float) -> torch.Tensor:
    """The margin ``m`` added to DPO's target (0 for ``clip``, which moves the target instead);
    inputs are ℓref (length-normalised when the loss is)."""
    if variant == "cpo":
        return F.softplus(tau * (gamma - (ref_chosen - ref_rejected))) / tau
    if variant == "easy":
        return gamma * (1.0 / ref_chosen + 1.0 / ref_rejected)
    if variant == "clip":
        return torch.zeros_like(ref_chosen)
    raise ValueError(f"variant must be one of {CONSTRAINED_VARIANTS}, got {variant!r}")


def constrained_preference_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                                  ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, *,
                                  variant: ConstrainedVariant = "cpo", beta: float = 0.1, gamma: float = 0.5,
                                  tau: float = 2.0, alpha: float = 1.0, chosen_lengths: torch.Tensor | None = None,
                                  rejected_lengths: torch.Tensor | None = None,
                                  length_normalize: bool = True) -> torch.Tensor:
    """Per-pair Constrained Preference Optimization losses ``[B]`` (module docstring; paper 6's
    ``cpo_loss``, ``easy_cpo_loss`` and ``clip_loss``). ``length_normalize`` (default, as the
    paper's code) turns the summed log-probs into ℓ = sum / length."""
    if beta <= 0 or tau <= 0 or alpha <= 0:
        raise ValueError(f"beta, tau and alpha must be positive, got {beta}, {tau}, {alpha}")
    if length_normalize:
        chosen_logps, ref_chosen_logps = normalise(chosen_logps, chosen_lengths), normalise(ref_chosen_logps,
                                                                                             chosen_lengths)
        rejected_logps, ref_rejected_logps = normalise(rejected_logps, rejected_lengths), normalise(
            ref_rejected_logps, rejected_lengths)
    d_theta = chosen_logps - rejected_logps
    d_ref = ref_chosen_logps - ref_rejected_logps
    m = constrained_margin(ref_chosen_logps, ref_rejected_logps, variant=variant, gamma=gamma, tau=tau)
    if variant == "cpo":
        logits = beta * d_theta - beta * d_ref - (beta / alpha) * m
    elif variant == "easy":
        logits = beta * d_theta - beta * d_ref - m
    else:
        logits = beta * (d_theta - torch.clamp(d_ref, min=0.0))
    return -F.logsigmoid(logits)


def preference_metrics(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
                       ref_rejected_logps: torch.Tensor, *, beta: float, chosen_lengths: torch.Tensor,
                       rejected_lengths: torch.Tensor, length_normalize: bool) -> dict[str, torch.Tensor]:
    """Batch sums (the trainer divides by the pair count) of TRL's DPO metrics plus paper 6's:
    ``delta_theta`` (Δθ), ``delta_ref`` (Δref) and ``policy_accuracy`` (Δθ > 0: the policy itself,
    not its advantage over the reference, prefers the chosen answer)."""
    with torch.no_grad():
        c, r, rc, rr = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
        if length_normalize:
            c, rc = normalise(c, chosen_lengths), normalise(rc, chosen_lengths)
            r, rr = normalise(r, rejected_lengths), normalise(rr, rejected_lengths)
        chosen_rewards, rejected_rewards = beta * (c - rc), beta * (r - rr)
        return {"rewards/chosen": chosen_rewards.sum(), "rewards/rejected": rejected_rewards.sum(),
                "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
                "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
                "logps/chosen": chosen_logps.sum(), "logps/rejected": rejected_logps.sum(),
                "delta_theta": (c - r).sum(), "delta_ref": (rc - rr).sum(),
                "policy_accuracy": (c > r).float().sum()}
