"""The viewer's reading of a run: its steps in order (built by :mod:`closedloop.trace_layout`,
which the OTLP export shares), the approvals it waits on, tool JSON shown indented."""

from __future__ import annotations

import json

from closedloop.messages import AssistantMessage, ToolMessage
from closedloop.store import RunRecord
from closedloop.trace_layout import Step, Trace, build_trace

__all__ = ["Step", "Trace", "build_trace", "pending_approvals"]


def pending_approvals(run: RunRecord) -> list[str]:
    """Tool calls the last assistant message asked for that have no result: what a ``waiting``
    run was interrupted on (an approval nobody answered)."""
    answered = {m.tool_call_id for m in run.messages if isinstance(m, ToolMessage)}
    last = next((m for m in reversed(run.messages) if isinstance(m, AssistantMessage)), None)
    if last is None or not last.tool_calls:
        return []
    return [f"{c.name}({c.function.arguments})" for c in last.tool_calls if c.id not in answered]


def pretty_json(text: str | None) -> str:
    """Tool arguments and results as indented JSON when they are JSON, else as recorded."""
    if text is None:
        return ""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):
        return text
