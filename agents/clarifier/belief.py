"""A Bayesian belief over candidate goals, and when to ask.

The belief is the posterior over a finite candidate set G given the conversation h:

    b(g) = p(g) · p_φ(g | h)^(1/τ) / Σ_g' p(g') · p_φ(g' | h)^(1/τ)

with a prior p(g) (uniform by default) and the frozen scorer's teacher-forced likelihoods at
temperature τ. ``length_normalize`` divides each log-likelihood by the goal's token count, for
candidate sets whose lengths differ a lot (it flattens the belief, so it is off by default).
The clarifier asks only while the belief is uncertain, measured by its normalised entropy
H(b)/log|G| ∈ [0, 1] ("surgical" clarification), and never more than a budget of questions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from closedloop.messages import _Message

from closedloop.agents.clarifier.scorer import GoalScorer


@dataclass
class Belief:
    goals: list[str]
    probs: list[float]

    @property
    def entropy(self) -> float:
        return -sum(p * math.log(p) for p in self.probs if p > 0)

    @property
    def normalized_entropy(self) -> float:
        return self.entropy / math.log(len(self.goals)) if len(self.goals) > 1 else 0.0

    @property
    def map_goal(self) -> str:
        return self.goals[max(range(len(self.probs)), key=self.probs.__getitem__)]

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.goals, self.probs))


@dataclass
class BeliefTracker:
    scorer: GoalScorer
    temperature: float = 1.0
    prior: dict[str, float] = field(default_factory=dict)
    length_normalize: bool = False

    def belief(self, messages: Sequence[_Message], candidates: Sequence[str]) -> Belief:
        if not candidates:
            raise ValueError("a belief needs at least one candidate goal")
        scores = self.scorer.logprobs([messages] * len(candidates), list(candidates))
        lengths = [max(1, len(self.scorer.tokenizer(g, add_special_tokens=False)["input_ids"]))
                   if self.length_normalize else 1 for g in candidates]
        logits = [s / n / self.temperature + math.log(self.prior.get(g, 1.0)) for s, n, g in zip(scores, lengths, candidates)]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        z = sum(weights)
        return Belief(list(candidates), [w / z for w in weights])


def should_ask(belief: Belief, *, threshold: float = 0.5, asked: int = 0, budget: int = 1) -> bool:
    """Ask while the normalised entropy exceeds ``threshold`` and questions remain in the budget."""
    return asked < budget and len(belief.goals) > 1 and belief.normalized_entropy > threshold
