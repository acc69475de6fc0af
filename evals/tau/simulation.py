"""Records of one episode and its grade, JSON-serialisable, shaped like tau2's results.json.

``RewardInfo.reward`` is ``None`` when a component of the reward basis could not be graded
(no judge configured, judge failure, incomplete gold replay, infrastructure error): an ungraded
episode never passes silently. ``partial_reward`` is the product over the components that were
graded, for diagnostics.
"""

from __future__ import annotations

import uuid
from enum import Enum
from typing import Any, Literal, Optional, Sequence

from pydantic import BaseModel, Field

from closedloop.evals.tau.data_model import Action, EnvAssertion, RewardType
from closedloop.evals.tau.user_messages import TauMessage
from closedloop.messages import Turn, Usage

__all__ = ["TerminationReason", "GRADED_TERMINATIONS", "DBCheck", "EnvAssertionCheck", "ActionCheck",
           "CommunicateCheck", "NLAssertionCheck", "ComponentStatus", "RewardInfo", "SimulationRun"]


class TerminationReason(str, Enum):
    USER_STOP = "user_stop"              # the user simulator sent ###STOP### / ###TRANSFER### / ###OUT-OF-SCOPE###
    AGENT_STOP = "agent_stop"            # the agent's text contained ###STOP###
    MAX_STEPS = "max_steps"
    TOO_MANY_ERRORS = "too_many_errors"  # tool errors reached max_errors (counted over the episode, as tau2)
    AGENT_ERROR = "agent_error"          # protocol violation (empty message; text+tools in strict mode) or agent bug
    USER_ERROR = "user_error"
    TIMEOUT = "timeout"
    INFRASTRUCTURE_ERROR = "infrastructure_error"  # a model server failed; excluded from metrics
    CONTEXT_WINDOW_EXCEEDED = "context_window_exceeded"  # the agent's prompt outgrew its model: scored 0, as tau2
    UNEXPECTED_ERROR = "unexpected_error"


# tau2 grades only episodes that ended by a stop; every other ending scores 0 (infra: not graded).
GRADED_TERMINATIONS = frozenset({TerminationReason.USER_STOP, TerminationReason.AGENT_STOP})

ComponentStatus = Literal["graded", "not_graded"]


class DBCheck(BaseModel):
    db_match: bool
    db_reward: float
    gold_hash: Optional[str] = None
    predicted_hash: Optional[str] = None
    user_db_match: Optional[bool] = None


class EnvAssertionCheck(BaseModel):
    env_assertion: EnvAssertion
    met: bool
    reward: float
    error: Optional[str] = None


class ActionCheck(BaseModel):
    action: Action
    action_match: bool
    action_reward: float
    tool_type: Optional[str] = None


class CommunicateCheck(BaseModel):
    info: str
    met: bool
    justification: str


class NLAssertionCheck(BaseModel):
    nl_assertion: str
    met: bool
    justification: str


class RewardInfo(BaseModel):
    """Every check of one graded episode: tau2's ``RewardInfo`` (same fields, same values; see
    :meth:`to_tau2`) plus what tau2 cannot say: what was not graded and why, the task file's
    hash, the judge's model and usage, gold actions that failed."""

    reward: Optional[float]
    db_check: Optional[DBCheck] = None
    env_assertions: Optional[list[EnvAssertionCheck]] = None
    action_checks: Optional[list[ActionCheck]] = None
    nl_assertions: Optional[list[NLAssertionCheck]] = None
    communicate_checks: Optional[list[CommunicateCheck]] = None
    reward_basis: Optional[list[RewardType]] = Field(default_factory=list)
    reward_breakdown: Optional[dict[RewardType, float]] = Field(default_factory=dict)
    info: Optional[dict[str, Any]] = Field(default_factory=dict)
    # ours
    partial_reward: float = 1.0
    not_graded: dict[RewardType, str] = Field(default_factory=dict)  # component -> why
    gold_failures: list[dict[str, Any]] = Field(default_factory=list)  # gold actions that raised (tau2 logs them)
    replay_mismatches: list[dict[str, Any]] = Field(default_factory=list)  # replayed writes whose output changed
    task_file_sha256: Optional[str] = None
    judge_model: Optional[str] = None
    judge_usage: Optional[Usage] = None

    @property
    def graded(self) -> bool:
        return self.reward is not None

    def to_tau2(self) -> Optional[dict[str, Any]]:
        """tau2's ``RewardInfo.model_dump(mode="json")``, or None for an ungraded episode (tau2
        has no ungraded reward: such a simulation carries ``reward_info: null``)."""
        if self.reward is None:
            return None

        def dump(items: Optional[Sequence[BaseModel]], fields: tuple[str, ...]) -> Optional[list[dict[str, Any]]]:
            if items is None:
                return None
            return [{f: v for f, v in item.model_dump(mode="json").items() if f in fields} for item in items]

        return {
            "reward": self.reward,
            "db_check": None if self.db_check is None else {"db_match": self.db_check.db_match,
                                                             "db_reward": self.db_check.db_reward},
            "env_assertions": dump(self.env_assertions, ("env_assertion", "met", "reward")),
            "action_checks": dump(self.action_checks, ("action", "action_match", "action_reward", "tool_type")),
            "nl_assertions": dump(self.nl_assertions, ("nl_assertion", "met", "justification")),
            "communicate_checks": dump(self.communicate_checks, ("info", "met", "justification")),
            "reward_basis": None if self.reward_basis is None else [b.value for b in self.reward_basis],
            "reward_breakdown": None if self.reward_breakdown is None else
            {k.value: v for k, v in self.reward_breakdown.items()},
            "info": self.info,
        }


class SimulationRun(BaseModel):
    """One episode: every message in order, why it ended, what it cost."""

    id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    task_id: str
    domain: str = ""
    trial: Optional[int] = None
    seed: Optional[int] = None
    start_time: str = ""
    end_time: str = ""
    duration: float = 0.0
    termination_reason: TerminationReason
    stop_token: Optional[str] = None
    error: Optional[str] = None  # the exception text behind AGENT_ERROR / USER_ERROR / INFRASTRUCTURE_ERROR
    steps: int = 0
    num_tool_errors: int = 0
    agent_cost: Optional[float] = None
    user_cost: Optional[float] = None
    agent_usage: Usage = Field(default_factory=Usage)
    user_usage: Usage = Field(default_factory=Usage)
    messages: list[TauMessage] = Field(default_factory=list)  # user messages may carry tool calls (telecom)
    agent_turns: list[Turn] = Field(default_factory=list)  # token-exact records when the agent returned Turns
    task_file_sha256: Optional[str] = None
    reward_info: Optional[RewardInfo] = None
