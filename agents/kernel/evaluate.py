"""Calling the injected evaluator tools from a graph node, recorded like any tool call.

The graphs call ``evaluate_kernel(code)`` themselves after each code-writing turn (the model is
not asked to issue the call: every candidate must be evaluated, and a weak model would skip it).
Each call is still a :class:`~closedloop.runtime.ToolRecord` tied to the turn that wrote the code,
so the run store shows it like a model-issued call.
"""

from __future__ import annotations

import json

from closedloop.agents.kernel.feedback import EvalResult, parse_eval_result
from closedloop.runtime.state import ToolRecord
from closedloop.tool import ToolRegistry

__all__ = ["EVALUATE_TOOL", "PROFILE_TOOL", "require_evaluator", "evaluate_code", "profile_code"]

EVALUATE_TOOL = "evaluate_kernel"
PROFILE_TOOL = "profile_kernel"


def require_evaluator(tools: ToolRegistry | None, graph: str) -> ToolRegistry:
    """The registry, checked to hold ``evaluate_kernel``; a clear error says where to get one."""
    if tools is None or EVALUATE_TOOL not in tools:
        have = sorted(t.name for t in tools) if tools else []
        raise ValueError(f"the {graph} graph needs an `{EVALUATE_TOOL}(code)` tool for its problem (got {have}); "
                         "build one with closedloop.evals.kernelbench.tools.make_kernel_tools(problem, backend) or "
                         "run it through `closedloop eval kernelbench --agent " + graph + "`")
    return tools


def _record(name: str, code: str, content: str, error: str | None, kind: str | None, latency: float,
            call_id: str, turn_idx: int | None) -> ToolRecord:
    return ToolRecord(call_id=call_id, name=name, arguments=json.dumps({"code": code}), content=content, error=error,
                      error_kind=kind, latency_s=latency, turn_idx=turn_idx)


async def evaluate_code(tools: ToolRegistry, code: str, *, call_id: str,
                        turn_idx: int | None = None) -> tuple[EvalResult, ToolRecord]:
    """Run ``evaluate_kernel`` on ``code``; a failing tool becomes a ``tool_error`` result, not a crash."""
    r = await tools.call_json(EVALUATE_TOOL, {"code": code})
    return (parse_eval_result(r.content, r.error),
            _record(EVALUATE_TOOL, code, r.content, r.error, r.error_kind, r.latency_s, call_id, turn_idx))


def _profile_first(content: str) -> str:
    """A JSON report with its profile and timings first (a long report is clipped at its end)."""
    try:
        data = json.loads(content)
    except (json.JSONDecodeError, TypeError):
        return content
    if not isinstance(data, dict):
        return content
    first = {k: data[k] for k in ("profile", "timings", "speedup", "status") if k in data}
    return json.dumps({**first, **{k: v for k, v in data.items() if k not in first}}, indent=1, default=str)


async def profile_code(tools: ToolRegistry, code: str, *, call_id: str,
                       turn_idx: int | None = None) -> tuple[str, ToolRecord | None]:
    """The profiler's report for ``code`` (``profile_kernel``), or a note when none is available."""
    if PROFILE_TOOL not in tools:
        return "(no profiler available for this backend: reason from the evaluator's timings)", None
    r = await tools.call_json(PROFILE_TOOL, {"code": code})
    report = _profile_first(r.content) if r.error is None else f"(the profiler failed: {r.error})"
    return report, _record(PROFILE_TOOL, code, r.content, r.error, r.error_kind, r.latency_s, call_id, turn_idx)
