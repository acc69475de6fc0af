"""The evaluator's verdict on one candidate, as the agents read and rank it.

``evaluate_kernel`` (``closedloop.evals.kernelbench.tools``) returns JSON with a ``status`` in
:data:`STATUSES`, a ``message``, and whatever helps fix the code (compiler log tail, max/mean
difference, traceback tail, speedup, timings). We keep every field (``extra="allow"``) so the
model sees what the evaluator said, and give names only to the two the agents decide on:
``status`` and ``speedup``.

Only ``correct`` counts as correct. ``suspicious`` (numerically right but implausibly fast, e.g.
above 10× or a roofline bound) is kept out, as it is kept out of ``fast_p``: an agent that
keeps a suspicious kernel as its best would be rewarded for the hack the flag is there to catch.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["STATUSES", "UNFIXABLE", "EvalResult", "parse_eval_result", "feedback_json", "better"]

#: The evaluator's statuses (``closedloop.evals.kernelbench.evaluate.STATUSES``, one layer up, so
#: written out here; a test keeps the two equal). ``invalid_output``: the candidate's side sent
#: something the judge cannot read (an unbuildable extension, a malformed or oversized reply).
STATUSES = ("policy_violation", "compile_error", "load_error", "runtime_error", "shape_mismatch", "dtype_mismatch",
            "incorrect", "invalid_output", "timeout", "correct", "suspicious", "reference_error", "infra_error")
#: Statuses the agents add: no code could be extracted; the tool itself failed (not the candidate's fault).
AGENT_STATUSES = ("no_code", "tool_error")
#: Failures no change to the candidate can fix (the evaluator's or the problem's own): nothing to debug.
UNFIXABLE = ("tool_error", "reference_error", "infra_error")


class EvalResult(BaseModel):
    """One evaluation. Unknown fields are kept and shown to the model."""

    model_config = ConfigDict(extra="allow")

    status: str
    message: str = ""
    speedup: float | None = None

    @property
    def correct(self) -> bool:
        return self.status == "correct"

    @property
    def fixable(self) -> bool:
        """Whether a different candidate could change this verdict (not an evaluator/problem failure)."""
        return self.status not in UNFIXABLE

    def summary(self) -> dict[str, Any]:
        """status and speedup only: what may cross a stage boundary (no logs, no diffs)."""
        return {"status": self.status, "speedup": self.speedup}


def parse_eval_result(content: str, error: str | None = None) -> EvalResult:
    """A tool result's content as an :class:`EvalResult`; a tool failure becomes ``tool_error``."""
    if error is not None:
        return EvalResult(status="tool_error", message=error)
    try:
        data = json.loads(content)
    except (json.JSONDecodeError, TypeError):
        return EvalResult(status="tool_error", message=f"the evaluator returned non-JSON output: {str(content)[:500]}")
    if not isinstance(data, dict) or not isinstance(data.get("status"), str):
        return EvalResult(status="tool_error", message=f"the evaluator's output has no status: {str(content)[:500]}")
    speedup = data.get("speedup")
    if speedup is not None and not isinstance(speedup, (int, float)):
        data["speedup"] = None  # e.g. "not timed": no figure, never a made-up one
        data.setdefault("speedup_note", str(speedup))
    return EvalResult.model_validate(data)


def _clip(value: Any, limit: int) -> Any:
    if isinstance(value, str) and len(value) > limit:
        return "…" + value[-limit:]  # logs and tracebacks say what went wrong at their end
    if isinstance(value, dict):
        return {k: _clip(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_clip(v, limit) for v in value[:50]]
    return value


def feedback_json(result: EvalResult, *, limit: int = 2000) -> str:
    """The structured feedback the model reads (EGG: within a stage, feedback is JSON)."""
    return json.dumps(_clip(result.model_dump(mode="json", exclude_none=True), limit), indent=1)


def better(new: EvalResult, old: EvalResult | None) -> bool:
    """Whether ``new`` should replace ``old`` as the best: correct, and faster when both are timed.

    An untimed correct result (``speedup`` None: Triton/CUDA without a GPU) replaces only a
    result that is not correct; with no timing there is no evidence that it is better.
    """
    if not new.correct:
        return False
    if old is None or not old.correct:
        return True
    if new.speedup is None:
        return False
    return old.speedup is None or new.speedup > old.speedup
