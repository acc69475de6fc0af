"""The profile agent's answer: JSON ``{"bottleneck": ..., "modification_plan": ...}`` (EGG, paper 2).

The agent reads the profiler's report (``profile_kernel``: torch-profiler top ops and a timing
breakdown on CPU; Nsight Compute where present) and names one bottleneck and a plan for the code
agent. The JSON may sit in a fenced ``json`` block or bare in the text; anything else is
invalid, and :func:`reask_message` tells the model exactly what was wrong so it can answer again
(the graph counts these re-asks).
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["ProfilePlan", "ProfileParseError", "parse_profile_plan", "reask_message", "PROFILE_SCHEMA_HINT"]

PROFILE_SCHEMA_HINT = ('{"bottleneck": "<one sentence: what limits this kernel now>", '
                       '"modification_plan": ["<concrete change 1>", "<concrete change 2>"]}')


class ProfilePlan(BaseModel):
    """A validated plan. ``modification_plan`` is a list of steps (a single string becomes one step)."""

    model_config = ConfigDict(extra="ignore")

    bottleneck: str = Field(min_length=1)
    modification_plan: list[str] = Field(min_length=1)

    @field_validator("bottleneck")
    @classmethod
    def _strip(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v.strip()

    @field_validator("modification_plan", mode="before")
    @classmethod
    def _steps(cls, v: object) -> object:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            steps = [s.strip() for s in v if isinstance(s, str) and s.strip()]
            if len(steps) != len(v):
                raise ValueError("every step must be a non-empty string")
            return steps
        return v

    def render(self) -> str:
        return "Bottleneck: " + self.bottleneck + "\nPlan:\n" + "\n".join(f"{i}. {s}" for i, s in
                                                                         enumerate(self.modification_plan, 1))


class ProfileParseError(ValueError):
    """The reply holds no valid plan; ``str(e)`` says why, for the re-ask."""


def _json_objects(text: str) -> list[object]:
    """JSON values in fenced ``json`` blocks first, then every decodable ``{...}`` in the text."""
    found: list[object] = []
    for body in re.findall(r"```[ \t]*(?:json)?[ \t]*\n(.*?)```", text, re.S | re.I):
        try:
            found.append(json.loads(body))
        except json.JSONDecodeError:
            pass
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        found.append(value)
    return found


def parse_profile_plan(text: str) -> ProfilePlan:
    """The first JSON object in ``text`` that is a valid plan; :class:`ProfileParseError` otherwise."""
    candidates = _json_objects(text or "")
    if not candidates:
        raise ProfileParseError("your reply contains no JSON object")
    problems = []
    for value in candidates:
        if not isinstance(value, dict):
            problems.append(f"expected a JSON object, got {type(value).__name__}")
            continue
        try:
            return ProfilePlan.model_validate(value)
        except ValidationError as e:
            problems.append("; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(root)'}: {err['msg']}"
                                      for err in e.errors()))
    raise ProfileParseError("the JSON is not a valid plan (" + problems[0] + ")")


def reask_message(error: ProfileParseError | str) -> str:
    return (f"That answer could not be used: {error}. Reply with only one JSON object of exactly this form, "
            f"no other text:\n{PROFILE_SCHEMA_HINT}")
