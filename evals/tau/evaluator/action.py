"""ACTION: each gold action must be matched by some tool call of the episode, the agent's or the
user's (same name; equal arguments, restricted to ``compare_args`` when set). As tau2
``ActionEvaluator``, the component is all-or-nothing: 1 only when every gold action matched.
``normalize_json_args=True`` (off by default; not tau2 main) also lets a JSON-encoded string
argument match the value it encodes."""

from __future__ import annotations

from typing import Any, Sequence

from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.simulation import ActionCheck
from closedloop.messages import AssistantMessage, UserMessage, _Message


def episode_tool_calls(messages: Sequence[_Message]) -> list[tuple[str, dict[str, Any]]]:
    calls: list[tuple[str, dict[str, Any]]] = []
    for m in messages:
        if isinstance(m, (AssistantMessage, UserMessage)) and getattr(m, "tool_calls", None):
            for call in m.tool_calls:  # type: ignore[union-attr]
                try:
                    calls.append((call.name, call.parsed_arguments()))
                except (ValueError, TypeError):
                    continue  # malformed arguments cannot match anything
    return calls


def check_actions(messages: Sequence[_Message], task: Task, tool_types: dict[str, str] | None = None, *,
                  normalize_json_args: bool = False) -> tuple[list[ActionCheck] | None, float, dict | None]:
    """(checks, reward, info): checks is None and info a note when the task has no gold actions."""
    actions = (task.evaluation_criteria.actions if task.evaluation_criteria else None) or []
    if not actions:
        return None, 1.0, {"note": "No actions to evaluate"}
    calls = episode_tool_calls(messages)
    checks = []
    for action in actions:
        matched = any(action.matches(name, args, normalize=normalize_json_args) for name, args in calls)
        checks.append(ActionCheck(action=action, action_match=matched, action_reward=1.0 if matched else 0.0,
                                  tool_type=(tool_types or {}).get(action.name)))
    return checks, 1.0 if all(c.action_match for c in checks) else 0.0, None
