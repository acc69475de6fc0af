"""The τ task schema: field for field tau2's ``Task`` (``src/tau2/data_model/tasks.py``).

Unknown keys are ignored (``annotations``, ``required_documents``, voice metadata, fields added upstream
later), so a newer tasks.json still loads; the fields that grading depends on are typed.
"""

from __future__ import annotations

import json
import textwrap
from enum import Enum
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

__all__ = ["RewardType", "StructuredUserInstructions", "UserScenario", "Description", "Action",
           "EnvFunctionCall", "EnvAssertion", "EvaluationCriteria", "InitializationData", "InitialState",
           "Task", "normalize_action_arg"]

Requestor = Literal["assistant", "user"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RewardType(str, Enum):
    """Components that can gate a task's reward (the reward is the product over ``reward_basis``)."""

    DB = "DB"
    ENV_ASSERTION = "ENV_ASSERTION"
    NL_ASSERTION = "NL_ASSERTION"
    ACTION = "ACTION"
    COMMUNICATE = "COMMUNICATE"


class StructuredUserInstructions(_Lenient):
    domain: str
    reason_for_call: str
    known_info: Optional[str] = None
    unknown_info: Optional[str] = None
    task_instructions: str

    def __str__(self) -> str:
        """Rendered exactly as tau2 renders it into the user simulator's ``<scenario>``."""
        tab = "\t"
        lines = [f"Domain: {self.domain}", f"Reason for call:\n{textwrap.indent(self.reason_for_call, tab)}"]
        if self.known_info is not None:
            lines.append(f"Known info:\n{textwrap.indent(self.known_info, tab)}")
        if self.unknown_info is not None:
            lines.append(f"Unknown info:\n{textwrap.indent(self.unknown_info, tab)}")
        lines.append(f"Task instructions:\n{textwrap.indent(self.task_instructions, tab)}")
        return "\n".join(lines)


class UserScenario(_Lenient):
    persona: Optional[str] = None
    instructions: Union[StructuredUserInstructions, str]

    def __str__(self) -> str:
        lines = []
        if self.persona is not None:
            lines += ["Persona:", textwrap.indent(self.persona, "\t")]
        lines += ["Instructions:", textwrap.indent(str(self.instructions), "\t")]
        return "\n".join(lines)


class Description(_Lenient):
    purpose: Optional[str] = None
    relevant_policies: Optional[str] = None
    notes: Optional[str] = None


def normalize_action_arg(value: Any) -> Any:
    """JSON-looking strings compare by value (a tau2 change that is not on its main branch)."""
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith(("{", "[")):
            try:
                return normalize_action_arg(json.loads(stripped))
            except json.JSONDecodeError:
                return value
        return value
    if isinstance(value, dict):
        return {k: normalize_action_arg(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize_action_arg(v) for v in value]
    return value


class Action(_Lenient):
    """One step of the reference trajectory (a tool call by the agent or the user)."""

    action_id: str
    requestor: Requestor = "assistant"
    name: str
    arguments: dict[str, Any]
    info: Optional[str] = None
    compare_args: Optional[list[str]] = None

    def matches(self, name: str, arguments: dict[str, Any], *, normalize: bool = False) -> bool:
        """tau2 ``compare_with_tool_call``: same name, and equal on ``compare_args`` (all of the
        call's arguments when None; an empty list means the name alone decides).
        ``normalize=True`` (not tau2 main) compares JSON-encoded strings by the value they encode."""
        if self.name != name:
            return False
        keys = list(arguments.keys()) if self.compare_args is None else self.compare_args
        if len(keys) == 0:
            return True
        norm = normalize_action_arg if normalize else (lambda v: v)
        got = {k: norm(v) for k, v in arguments.items() if k in keys}
        want = {k: norm(v) for k, v in self.arguments.items() if k in keys}
        return got == want


class EnvFunctionCall(_Lenient):
    env_type: Requestor
    func_name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class EnvAssertion(EnvFunctionCall):
    assert_value: bool = True
    message: Optional[str] = None


class EvaluationCriteria(_Lenient):
    actions: Optional[list[Action]] = None
    env_assertions: Optional[list[EnvAssertion]] = None
    communicate_info: Optional[list[str]] = None
    nl_assertions: Optional[list[str]] = None
    reward_basis: list[RewardType] = Field(default_factory=lambda: [RewardType.DB, RewardType.COMMUNICATE])


class InitializationData(_Lenient):
    agent_data: Optional[dict[str, Any]] = None
    user_data: Optional[dict[str, Any]] = None


class InitialState(_Lenient):
    initialization_data: Optional[InitializationData] = None
    initialization_actions: Optional[list[EnvFunctionCall]] = None
    # Kept raw: tau2's message format; replaying a pre-filled history is not supported yet.
    message_history: Optional[list[dict[str, Any]]] = None


class Task(_Lenient):
    id: str
    description: Optional[Description] = None
    user_scenario: UserScenario
    ticket: Optional[str] = None
    initial_state: Optional[InitialState] = None
    evaluation_criteria: Optional[EvaluationCriteria] = None
    issues: Optional[list[dict[str, Any]]] = None
    # τ³: the user tools offered to the user simulator, by name (None: all of the domain's)
    user_tools: Optional[list[str]] = None

    # Set by the loader: which file (by content hash) this task came from. Not serialised, so
    # exported tasks keep tau2's shape; results carry it in their own field.
    _source_sha256: Optional[str] = PrivateAttr(default=None)

    @property
    def source_sha256(self) -> Optional[str]:
        return self._source_sha256

    @property
    def reward_basis(self) -> list[RewardType]:
        if self.evaluation_criteria is None:
            return []
        return list(self.evaluation_criteria.reward_basis)
