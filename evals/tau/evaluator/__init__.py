"""Grading one episode as tau2's ``evaluate_simulation(..., EvaluationType.ALL)`` does:
termination gate, then DB, ENV_ASSERTION, ACTION, COMMUNICATE (always) and NL_ASSERTION (when
in the basis, or ``judge_all``); the reward is the product over the task's ``reward_basis``, and
``RewardInfo.to_tau2()`` equals tau2's record field for field.

:func:`grade` is synchronous and model-free, so it can run in a worker process (the runner does
that); :func:`evaluate` first asks the judge (async, in the caller's process) and then grades.

Where we differ from tau2 it is an explicit option, off by default:
``strict_gold_replay`` (a match against a gold state whose gold write failed is "not graded"
instead of graded; tau2 grades it, e.g. retail task 105), ``normalize_json_args`` (ACTION
compares JSON-encoded strings by value) and ``gold_sync`` (the gold actions are replayed with
``sync_tools`` after each, as live calls are; tau2's evaluator does not sync them, so on telecom
``db_match`` compares a synced trajectory with an unsynced gold state). Without a judge, NL_ASSERTION is *not graded* (tau2
always has one): the reward is None and ``not_graded`` says why, unless another component
already failed.
"""

from __future__ import annotations

from typing import Any, Callable

from closedloop.evals.tau.data_model import RewardType, Task
from closedloop.evals.tau.environment import Environment, EnvironmentFactory
from closedloop.evals.tau.evaluator.action import check_actions
from closedloop.evals.tau.evaluator.communicate import check_communicate
from closedloop.evals.tau.evaluator.db_check import check_db
from closedloop.evals.tau.evaluator.env_assertions import check_env_assertions
from closedloop.evals.tau.evaluator.nl_assertions import NLResult, check_nl_assertions
from closedloop.evals.tau.evaluator.termination import termination_gate
from closedloop.evals.tau.simulation import DBCheck, NLAssertionCheck, RewardInfo, SimulationRun
from closedloop.models.base import ModelClient, SamplingParams

__all__ = ["evaluate", "grade", "evaluate_tau2", "needs_judge"]

_ENV_BASES = {RewardType.DB, RewardType.ENV_ASSERTION}


def needs_judge(task: Task, *, judge_all: bool = False) -> bool:
    criteria = task.evaluation_criteria
    return criteria is not None and (RewardType.NL_ASSERTION in criteria.reward_basis or judge_all)


def _tool_types(env: Environment | None, environment_factory: EnvironmentFactory) -> dict[str, str]:
    data = getattr(environment_factory, "__self__", None)
    if env is None and data is not None and hasattr(data, "tool_types"):
        return data.tool_types()
    env = env or environment_factory()
    kinds = {t.name: t.kind for t in env.tool_list}  # type: ignore[attr-defined]
    if env.user_tools is not None:
        kinds.update({t.name: t.kind for t in env.user_tools})
    return kinds


def grade(simulation: SimulationRun, task: Task, environment_factory: EnvironmentFactory, *,
          nl: NLResult | None = None, strict_replay: bool = True, strict_gold_replay: bool = False,
          normalize_json_args: bool = False, gold_sync: bool = False) -> RewardInfo:
    """Everything but the judge. ``nl`` is the judge's result when NL_ASSERTION was evaluated
    (None: not evaluated, i.e. outside the basis)."""
    if simulation.task_id != task.id:
        raise ValueError(f"simulation is for task {simulation.task_id!r}, not {task.id!r}")
    sha = task.source_sha256 or simulation.task_file_sha256
    gated = termination_gate(simulation, task)
    if gated is not None:
        gated.task_file_sha256 = sha
        return gated
    if task.evaluation_criteria is None:
        return RewardInfo(reward=1.0, reward_basis=None, reward_breakdown=None,
                          info={"note": "No evaluation criteria"}, task_file_sha256=sha)

    criteria = task.evaluation_criteria
    basis = list(criteria.reward_basis)
    messages = simulation.messages
    record = RewardInfo(reward=None, reward_basis=basis, task_file_sha256=sha)
    not_graded: dict[RewardType, str] = {}

    # ENV: DB hash and env assertions (tau2 EnvironmentEvaluator)
    env_breakdown: dict[RewardType, float] | None
    predicted: Environment | None = None
    if criteria.actions is None and criteria.env_assertions is None:
        record.db_check = DBCheck(db_match=True, db_reward=1.0)
        env_reward, env_breakdown, env_info = 1.0, None, {"note": "No expected actions or env assertions"}
    else:
        db = check_db(messages, task, environment_factory, strict=strict_replay, gold_sync=gold_sync)
        record.db_check, predicted = db.check, db.predicted
        record.gold_failures = db.gold_failures
        checks, assertion_reward = check_env_assertions(db.predicted, task)
        record.env_assertions = checks
        env_breakdown, env_reward, env_info = {}, 1.0, None
        if RewardType.DB in basis:
            env_breakdown[RewardType.DB] = db.check.db_reward
            env_reward *= db.check.db_reward
            if strict_gold_replay and db.check.db_match and any(f["mutating"] for f in db.gold_failures):
                not_graded[RewardType.DB] = "gold replay incomplete: a gold write failed, so a match certifies nothing"
        if RewardType.ENV_ASSERTION in basis:
            env_breakdown[RewardType.ENV_ASSERTION] = assertion_reward
            env_reward *= assertion_reward
        record.replay_mismatches = db.replay_mismatches

    record.action_checks, action_reward, action_info = check_actions(
        messages, task, _tool_types(predicted, environment_factory), normalize_json_args=normalize_json_args)
    record.communicate_checks, comm_reward, comm_info = check_communicate(messages, task)

    nl_reward: float | None = None
    nl_info: dict | None = None
    if nl is not None:
        record.nl_assertions, nl_reward = nl.checks, nl.reward
        record.judge_usage, record.judge_model = nl.usage, nl.model
        nl_info = nl.info
        if nl.reward is None:
            not_graded[RewardType.NL_ASSERTION] = nl.error or "not graded"
    elif RewardType.NL_ASSERTION in basis:
        not_graded[RewardType.NL_ASSERTION] = "not graded: the judge was not asked"

    reward, breakdown = 1.0, {}
    if set(basis) & _ENV_BASES:
        breakdown.update(env_breakdown or {})
        reward *= env_reward
    if RewardType.ACTION in basis:
        breakdown[RewardType.ACTION] = action_reward
        reward *= action_reward
    if RewardType.NL_ASSERTION in basis and nl_reward is not None:
        breakdown[RewardType.NL_ASSERTION] = nl_reward
        reward *= nl_reward
    if RewardType.COMMUNICATE in basis:
        breakdown[RewardType.COMMUNICATE] = comm_reward
        reward *= comm_reward
    record.reward_breakdown = breakdown
    record.not_graded = not_graded
    record.partial_reward = reward
    # A failed graded component already decides the episode (the product is 0); otherwise any
    # ungraded component leaves the reward unknown.
    record.reward = reward if (not not_graded or reward == 0.0) else None
    record.info = {"env": env_info, "nl": nl_info, "communicate": comm_info, "action": action_info}
    return record


async def evaluate(simulation: SimulationRun, task: Task, environment_factory: EnvironmentFactory,
                   judge: ModelClient | None = None, *, strict_replay: bool = True, judge_all: bool = False,
                   judge_params: SamplingParams | None = None, strict_gold_replay: bool = False,
                   normalize_json_args: bool = False, gold_sync: bool = False) -> RewardInfo:
    """Judge (when the basis needs it, or ``judge_all`` with a judge), then :func:`grade`."""
    nl = None
    gated = simulation.termination_reason not in {"user_stop", "agent_stop"}
    if not gated and task.evaluation_criteria is not None and (
            RewardType.NL_ASSERTION in task.reward_basis or (judge_all and judge is not None)):
        nl = await check_nl_assertions(simulation.messages, task.evaluation_criteria.nl_assertions, judge,
                                       judge_params)
    return grade(simulation, task, environment_factory, nl=nl, strict_replay=strict_replay,
                 strict_gold_replay=strict_gold_replay, normalize_json_args=normalize_json_args,
                 gold_sync=gold_sync)


def evaluate_tau2(simulation: SimulationRun, task: Task, environment_factory: EnvironmentFactory, *,
                  nl_judge: Callable[[list[str]], list[dict[str, Any]]] | None = None,
                  **options: Any) -> dict[str, Any] | None:
    """tau2's ``reward_info`` as a dict, with a synchronous NL judge ``assertions -> checks``
    (for cross-checks against tau2's own records)."""
    nl = None
    if needs_judge(task) and nl_judge is not None:
        assertions = task.evaluation_criteria.nl_assertions or []  # type: ignore[union-attr]
        if not assertions:
            nl = NLResult(checks=[], reward=1.0, info={"note": "No nl_assertions to evaluate"})
        else:
            checks = [NLAssertionCheck.model_validate(c) for c in nl_judge(assertions)]
            nl = NLResult(checks=checks, reward=1.0 if all(c.met for c in checks) else 0.0)
    return grade(simulation, task, environment_factory, nl=nl, **options).to_tau2()
