"""The decision-aware reward of FactGuard (paper 1): R = R_acc + R_format + λ·R_risk + R_tool.

* R_acc = ``acc`` for the right label, else 0.
* R_format = ``format`` when the answer is ``<think>…</think><answer>…</answer>``, else 0.
* R_risk = −α·1[FP] − γ·1[FN], "fake" being the positive class: a false positive flags a real
  video as fake, a false negative lets a fake one through. Weighted by λ. α:γ = 1:1 by default
  (the paper's); raising α relative to γ makes flagging costlier, so a policy trained with it
  flags less: precision up, recall down (the paper's Table 2).
* R_tool = +r⁺ when a tool was used and the answer is right (R_acc > 0), −r⁻ when a tool was used
  and it is wrong, 0 without tools: a tool is worth calling only when it helps.

The paper does not give λ, r⁺, r⁻; the defaults here (1, 0.2, 0.2) are ours, all configurable.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from closedloop.agents.factguard.prompts import Label


class RewardBreakdown(BaseModel):
    acc: float
    format: float
    risk: float  # already multiplied by λ
    tool: float

    @property
    def total(self) -> float:
        return self.acc + self.format + self.risk + self.tool

    def components(self) -> dict[str, float]:
        return {"acc": self.acc, "format": self.format, "risk": self.risk, "tool": self.tool}


class DecisionReward(BaseModel):
    """Every coefficient of the decision-aware reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    acc: float = Field(1.0, ge=0)
    format: float = Field(0.5, ge=0)
    lam: float = Field(1.0, ge=0, description="λ, the weight of R_risk")
    alpha: float = Field(1.0, ge=0, description="α, the cost of a false positive (real flagged as fake)")
    gamma: float = Field(1.0, ge=0, description="γ, the cost of a false negative (fake passed as real)")
    r_plus: float = Field(0.2, ge=0, description="r⁺, bonus for a tool used on a right answer")
    r_minus: float = Field(0.2, ge=0, description="r⁻, penalty for a tool used on a wrong answer")

    def score(self, predicted: Label | None, label: Label, *, well_formed: bool, used_tool: bool) -> RewardBreakdown:
        """The four components for one answer. No valid answer counts as wrong, and as a false
        negative when the video is fake (nothing was flagged)."""
        correct = predicted == label
        r_acc = self.acc if correct else 0.0
        fp = predicted == "fake" and label == "real"
        fn = predicted != "fake" and label == "fake"
        r_risk = -(self.alpha * fp + self.gamma * fn)
        r_tool = 0.0 if not used_tool else (self.r_plus if r_acc > 0 else -self.r_minus)
        return RewardBreakdown(acc=r_acc, format=self.format if well_formed else 0.0, risk=self.lam * r_risk,
                               tool=r_tool)
