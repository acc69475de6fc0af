"""NL_ASSERTION: one call to a judge model that grades each natural-language assertion against
the transcript (tau2 ``NLAssertionsEvaluator``: same prompt, "role: content" transcript, JSON
``results[{expectedOutcome, reasoning, metExpectation}]``).

The judge is any :class:`~closedloop.models.ModelClient` (tau2's default is gpt-4.1 at
temperature 0). Its tokens and cost are recorded. With no judge, or when the judge's answer
cannot be read, the component is *not graded*: it never passes by default.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence

from closedloop.evals.tau.simulation import NLAssertionCheck
from closedloop.messages import AssistantMessage, SystemMessage, UserMessage, Usage, _Message
from closedloop.models.base import ModelClient, SamplingParams

JUDGE_SYSTEM_PROMPT = """
        TASK
        - You will be given a list of expected outcomes and a conversation that was collected during a test case run.
        - The conversation is between an agent and a customer.
        - Your job is to evaluate whether the agent satisfies each of the expected outcomes.
        - Grade each expected outcome individually.

        FORMAT
        - Your response should be a JSON object with the following fields:
        - `reasoning`: a short explanation for your classification
        - `metExpectation`: `true` if the agent satisfies the expected outcomes, `false` otherwise
        - `expectedOutcome`: repeat the expectation from the input that you are grading
        
        Example response structure:
        {
            "results": [
                {
                    "expectedOutcome": "<one of the expected outcomes from the input>",
                    "reasoning": "<reasoning trace>",
                    "metExpectation": <false or true>,
                }
            ]
        }
        """

JUDGE_PARAMS = SamplingParams(temperature=0.0, max_tokens=4096, logprobs=False)


@dataclass
class NLResult:
    checks: list[NLAssertionCheck] | None  # None: not graded
    reward: float | None
    usage: Usage | None = None
    model: str | None = None
    error: str | None = None
    info: dict | None = None  # tau2's component info (a note when there was nothing to judge)


def transcript(messages: Sequence[_Message]) -> str:
    """tau2's "role: content" rendering (tool-call-only messages show ``None``, as upstream)."""
    lines = []
    for m in messages:
        content = getattr(m, "content", None)
        lines.append(f"{m.role}: {m.text if content is not None else None}")
    return "\n".join(lines)


def judge_messages(messages: Sequence[_Message], assertions: list[str]) -> list[_Message]:
    user_prompt = f"""
        conversation:
        {transcript(messages)}
        
        expectedOutcomes:
        {assertions}
        """
    return [SystemMessage(content=JUDGE_SYSTEM_PROMPT), UserMessage(content=user_prompt)]


def _parse(text: str) -> dict:
    """The judge's JSON, tolerating a ```json fence around it."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    return json.loads(fenced.group(1) if fenced else text)


async def check_nl_assertions(messages: Sequence[_Message], assertions: list[str] | None,
                              judge: ModelClient | None, params: SamplingParams | None = None) -> NLResult:
    if not assertions:
        return NLResult(checks=[], reward=1.0, info={"note": "No nl_assertions to evaluate"})
    if judge is None:
        return NLResult(checks=None, reward=None, error="not graded: no judge model configured")
    try:
        turn = await judge.generate(judge_messages(messages, assertions), params=params or JUDGE_PARAMS)
    except Exception as e:  # the judge is infrastructure: its failure leaves the component ungraded
        return NLResult(None, None, None, getattr(judge, "spec", None) or type(judge).__name__,
                        f"not graded: judge call failed ({type(e).__name__}: {e})")
    model = turn.model or getattr(judge, "spec", "") or type(judge).__name__
    raw = turn.message.text if isinstance(turn.message, AssistantMessage) else ""
    try:
        results = _parse(raw).get("results", [])
        checks = [NLAssertionCheck(nl_assertion=str(r["expectedOutcome"]), met=bool(r["metExpectation"]),
                                   justification=str(r.get("reasoning", ""))) for r in results]
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:
        return NLResult(None, None, turn.usage, model, f"not graded: judge answer unreadable ({type(e).__name__}: {e})")
    if len(checks) != len(assertions):
        return NLResult(checks, None, turn.usage, model,
                        f"not graded: judge graded {len(checks)} outcomes, expected {len(assertions)}")
    return NLResult(checks, 1.0 if all(c.met for c in checks) else 0.0, turn.usage, model)
