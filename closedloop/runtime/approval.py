"""Human approval of tool calls, in LangChain's human-in-the-loop shapes.

The tool node pauses with one ``interrupt`` carrying :func:`approval_request` (``action_requests``
+ ``review_configs``, what LangGraph Studio and Agent Inbox render) and reads the resume value
with :func:`parse_decisions`.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from closedloop.messages import FunctionCall, ToolCall

#: What a reviewer may decide about a pending tool call (LangChain's human-in-the-loop decisions).
DECISIONS = ["approve", "edit", "reject"]


def approval_request(calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The interrupt payload for calls awaiting review, in LangChain's ``HITLRequest`` shape
    (``action_requests`` + ``review_configs``), which LangGraph Studio and Agent Inbox render.
    ``args`` is the parsed argument object, or the raw string when the model's JSON is malformed;
    each request also names its ``tool_call_id``."""
    actions = []
    for call in calls:
        try:
            args: Any = call.parsed_arguments()
        except (ValueError, TypeError):
            args = call.function.arguments
        actions.append({"name": call.name, "args": args, "tool_call_id": call.id,
                        "description": f"Tool execution pending approval\n\nTool: {call.name}\nArgs: "
                                       f"{call.function.arguments}"})
    names = list(dict.fromkeys(c.name for c in calls))
    return {"action_requests": actions,
            "review_configs": [{"action_name": n, "allowed_decisions": list(DECISIONS)} for n in names]}


Decision = tuple[str, Any]  # ("approve", None) | ("reject", message | None) | ("edit", ToolCall)


def parse_decisions(value: Any, calls: Sequence[ToolCall]) -> list[Decision]:
    """Resume values: LangChain's ``{"decisions": [{"type": "approve"} | {"type": "reject", "message": ...}
    | {"type": "edit", "edited_action": {"name": ..., "args": {...}}}, ...]}``, one per pending call in
    order; or, for all pending calls at once, ``True``/``False``, ``"approve"``/``"reject"``,
    ``{"approve": bool, "reason": str}``. Anything else is a ``ValueError`` naming what was expected."""
    if isinstance(value, dict) and "decisions" in value:
        items = value["decisions"]
        if not isinstance(items, list) or len(items) != len(calls):
            raise ValueError(f"resume with one decision per pending tool call: {len(calls)} expected, got "
                             f"{len(items) if isinstance(items, list) else type(items).__name__}")
        out: list[Decision] = []
        for call, d in zip(calls, items):
            kind = d.get("type") if isinstance(d, dict) else None
            if kind == "approve":
                out.append(("approve", None))
            elif kind == "reject":
                out.append(("reject", d.get("message")))
            elif kind == "edit":
                action = d.get("edited_action") or {}
                args = action.get("args", {})
                out.append(("edit", ToolCall(id=call.id, function=FunctionCall(
                    name=action.get("name") or call.name,
                    arguments=args if isinstance(args, str) else json.dumps(args)))))
            else:
                raise ValueError(f"unknown decision {d!r}; use a dict with type one of {DECISIONS}")
        return out
    if isinstance(value, dict) and "approve" in value:
        one: Decision = ("approve", None) if value.get("approve") else ("reject", value.get("reason"))
    elif isinstance(value, str):
        one = ("approve", None) if value.strip().lower() in {"approve", "approved", "yes", "y"} else ("reject", None)
    elif isinstance(value, bool):
        one = ("approve", None) if value else ("reject", None)
    else:
        raise ValueError(f"cannot read a review decision from {value!r}; resume with "
                         "{'decisions': [{'type': 'approve'|'edit'|'reject', ...}]}")
    return [one] * len(calls)


__all__ = ["DECISIONS", "Decision", "approval_request", "parse_decisions"]
