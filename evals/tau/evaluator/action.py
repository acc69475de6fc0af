"""ACTION: each gold action must be matched by some tool call of the episode (same name;
equal arguments, restricted to ``compare_args`` when set). As tau2 ``ActionEvaluator``, the
component is the mean of the per-action rewards, so it is 1 only when every action matched."""

from __future__ import annotations

from typing import Any

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.simulation import ActionCheck
from closedloop.messages import AssistantMessage, _Message


def episode_tool_calls(messages: list[_Message]) -> list[tuple[str, dict[str, Any]]]:
    calls: list[tuple[str, dict[str, Any]]] = []
    for m in messages:
        if isinstance(m, AssistantMessage) and m.tool_calls:
            for call in m.tool_calls:
                try:
                    calls.append((call.name, call.parsed_arguments()))
                except (ValueError, TypeError):
                    continue  # malformed arguments cannot match anything
    return calls


def check_actions(messages: list[_Message], task: Task) -> tuple[list[ActionCheck], float]:
    actions = (task.evaluation_criteria.actions if task.evaluation_criteria else None) or []
    calls = episode_tool_calls(messages)
    checks = []
    for action in actions:
        matched = any(action.matches(name, args) for name, args in calls)
        checks.append(ActionCheck(action=action, action_match=matched, action_reward=1.0 if matched else 0.0))
    if not checks:
        return checks, 1.0
    return checks, sum(c.action_reward for c in checks) / len(checks)
