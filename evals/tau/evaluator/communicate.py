"""COMMUNICATE: every ``communicate_info`` string must appear in some agent text message,
lowercased with commas removed (tau2 ``CommunicateEvaluator``; note that "10" also matches
"100", an upstream quirk kept for comparability)."""

from __future__ import annotations

from typing import Sequence

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.simulation import CommunicateCheck
from closedloop.messages import AssistantMessage, _Message


def check_communicate(messages: Sequence[_Message], task: Task) -> tuple[list[CommunicateCheck] | None, float, dict | None]:
    """(checks, reward, info): checks is None and info a note when there is nothing to check."""
    infos = (task.evaluation_criteria.communicate_info if task.evaluation_criteria else None) or []
    if not infos:
        return None, 1.0, {"note": "No communicate_info to evaluate"}
    texts = [m.text for m in messages if isinstance(m, AssistantMessage) and m.content is not None and m.text]
    checks: list[CommunicateCheck] = []
    for info in infos:
        hit = next((t for t in texts if info.lower() in t.lower().replace(",", "")), None)
        if hit is not None:
            checks.append(CommunicateCheck(info=info, met=True,
                                           justification=f"Information '{info}' communicated in the message:\n '{hit}'"))
        else:
            checks.append(CommunicateCheck(info=info, met=False,
                                           justification=f"Information '{info}' not communicated."))
    return checks, 1.0 if all(c.met for c in checks) else 0.0, None
