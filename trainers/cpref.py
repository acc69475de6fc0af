"""Constrained Preference Optimization (paper 6: Yang et al., "Conditional Equivalence of DPO and RLHF").

``closedloop train cpref``. Named ``cpref`` / :class:`ConstrainedPreferenceConfig` because TRL's
``CPOTrainer`` is an unrelated method (Contrastive Preference Optimization); the paper's own code
calls it ``CPOTrainer`` too. Same data, reference handling and loop as DPO (:mod:`.dpo`); the loss
is :func:`~closedloop.trainers.preference_loss.constrained_preference_losses` with its three
branches (``cpo``, ``easy``, ``clip``). Defaults follow the paper's code: γ = 0.5, τ = 2, α = 1,
β = 0.1, log-probs normalised by completion length.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Literal

import torch
from pydantic import Field

from closedloop.trainers.dpo import PreferenceConfig, PreferenceResult, train_preference
from closedloop.trainers.preference_loss import constrained_preference_losses

__all__ = ["CONFIG_CLASS", "ConstrainedPreferenceConfig", "train_cpref", "run_from_config"]


class ConstrainedPreferenceConfig(PreferenceConfig):
    """DPO whose target margin cannot fall below γ when the reference prefers the rejected answer."""

    variant: Literal["cpo", "easy", "clip"] = Field(
        "cpo", description="cpo: margin softplus(tau*(gamma - Δref))/tau scaled by beta/alpha; easy: length-aware "
                           "margin gamma*(1/ℓref(y_w) + 1/ℓref(y_l)); clip: Δref clipped at 0 (paper 6's branches).")
    gamma: float = Field(0.5, description="γ: the preference margin the policy must reach (cpo), or the easy "
                                          "margin's scale (paper code default 0.5; its demo config 0.05).")
    tau: float = Field(2.0, gt=0, description="τ: sharpness of the soft max(0, γ − Δref) in cpo (default 2).")
    alpha: float = Field(1.0, gt=0, description="α: the cpo margin enters as (β/α)·m (default 1).")
    length_normalize: bool = Field(True, description="ℓ(y) = summed log-prob / completion length, as the paper's "
                                                     "code (false: summed log-probs, as DPO).")

    def pair_losses(self, logps: torch.Tensor, ref_logps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        c, r = logps.chunk(2)
        rc, rr = ref_logps.chunk(2)
        lc, lr = lengths.chunk(2)
        return constrained_preference_losses(c, r, rc, rr, variant=self.variant, beta=self.beta, gamma=self.gamma,
                                             tau=self.tau, alpha=self.alpha, chosen_lengths=lc, rejected_lengths=lr,
                                             length_normalize=self.length_normalize)


def train_cpref(config: ConstrainedPreferenceConfig, rows: Iterable[dict[str, Any]] | None = None, *,
                model: Any = None, tokenizer: Any = None,
                on_step: Callable[[int, dict[str, float]], None] | None = None) -> PreferenceResult:
    """Constrained Preference Optimization on ``rows`` or ``config.dataset`` (see :func:`.dpo.train_dpo`)."""
    return train_preference(config, rows, model=model, tokenizer=tokenizer, kind="cpref", on_step=on_step)


CONFIG_CLASS = ConstrainedPreferenceConfig


def run_from_config(config: ConstrainedPreferenceConfig) -> PreferenceResult:
    """The ``closedloop train cpref`` entry point."""
    return train_cpref(config)
