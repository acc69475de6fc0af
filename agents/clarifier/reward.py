"""The information-gain reward for clarifying questions.

    IG(q, a) = log p_φ(g* | instr, hist, q, a) − log p_φ(g* | instr, hist)

with a frozen scorer φ (:class:`~.scorer.GoalScorer`) and the serialised ground-truth goal g*.
A question whose answer tells the scorer nothing about g* earns ≈ 0; an answer that states g*
earns a large positive reward. A plain function of a trajectory, so trainers can call it on any
rollout (as a per-step reward on the turns that asked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from closedloop.messages import AssistantMessage, Trajectory, UserMessage, _Message

from closedloop.agents.clarifier.scorer import GoalScorer


@dataclass
class Exchange:
    """A clarification exchange: the assistant's question at ``index``, the user's answer after it."""

    index: int  # position of the question in the message list
    question: str
    answer: str


def information_gain(scorer: GoalScorer, history: Sequence[_Message], question: str, answer: str, goal: str) -> float:
    """IG of one exchange appended to ``history``."""
    before = list(history)
    after = before + [AssistantMessage(content=question), UserMessage(content=answer)]
    lp_before, lp_after = scorer.logprobs([before, after], [goal, goal])
    return lp_after - lp_before


def clarification_exchanges(messages: Sequence[_Message]) -> list[Exchange]:
    """Assistant text turns (no tool calls) that end in a question and are answered by the user."""
    found = []
    for i in range(len(messages) - 1):
        m, nxt = messages[i], messages[i + 1]
        if isinstance(m, AssistantMessage) and not m.tool_calls and m.text.strip().endswith("?") \
                and isinstance(nxt, UserMessage) and i > 0:
            found.append(Exchange(i, m.text, nxt.text))
    return found


def trajectory_information_gain(scorer: GoalScorer, trajectory: Trajectory, goal: str) -> list[tuple[int, float]]:
    """(message index of the question, IG) for every clarification exchange, in one batched pass."""
    msgs = list(trajectory.messages)
    exchanges = clarification_exchanges(msgs)
    if not exchanges:
        return []
    contexts = []
    for ex in exchanges:
        contexts += [msgs[: ex.index], msgs[: ex.index + 2]]
    scores = scorer.logprobs(contexts, [goal] * len(contexts))
    return [(ex.index, scores[2 * k + 1] - scores[2 * k]) for k, ex in enumerate(exchanges)]
