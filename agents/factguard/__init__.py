"""FactGuard's agent side (paper 1): prompts, the verdict format, and the decision-aware reward.

The agent reads a short video (frames), its ASR transcript and its metadata; it reasons and
judges whether the evidence it has is enough. If not, it calls tools (``factprobe`` for outside
evidence, ``clipscout`` once to look closer at a span of the video), reasons again, and answers
``<think>…</think><answer>real|fake</answer>``. The graph is :mod:`closedloop.graphs.factguard`;
the environment, data and evaluation are in :mod:`closedloop.evals.factguard`.
"""

from closedloop.agents.factguard.prompts import (STAGE1_SYSTEM_PROMPT, STAGE2_INSTRUCTION, Verdict, parse_verdict,
                                                 sample_prompt)
from closedloop.agents.factguard.reward import DecisionReward, RewardBreakdown

__all__ = ["STAGE1_SYSTEM_PROMPT", "STAGE2_INSTRUCTION", "Verdict", "parse_verdict", "sample_prompt",
           "DecisionReward", "RewardBreakdown"]
