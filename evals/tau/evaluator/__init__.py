"""Grading one episode: termination gate, then DB, ENV_ASSERTION, COMMUNICATE, NL_ASSERTION and
ACTION checks; the reward is the product over the task's ``reward_basis``.

Components outside the basis still run when they are free (DB, env assertions, communicate,
action) and appear in the record as diagnostics; the judge runs only for a basis that needs it
(or with ``judge_all=True``), since it costs money.
"""

from __future__ import annotations

from closedloop.evals.tau.data_model import RewardType, Task
from closedloop.evals.tau.environment import EnvironmentFactory
from closedloop.evals.tau.evaluator.action import check_actions
from closedloop.evals.tau.evaluator.communicate import check_communicate
from closedloop.evals.tau.evaluator.db_check import DBResult, check_db
from closedloop.evals.tau.evaluator.env_assertions import check_env_assertions
from closedloop.evals.tau.evaluator.nl_assertions import check_nl_assertions
from closedloop.evals.tau.evaluator.termination import termination_gate
from closedloop.evals.tau.simulation import DBCheck, RewardInfo, SimulationRun
from closedloop.models.base import ModelClient, SamplingParams

__all__ = ["evaluate"]


def _apply_db(db: DBResult, record: RewardInfo, components: dict, not_graded: dict, info: dict) -> None:
    record.db_check = db.check
    if db.replay_mismatches:
        info["replay_mismatches"] = db.replay_mismatches
    if db.gold_failures:
        info["gold_replay_incomplete"] = True
        info["failed_mutating_actions"] = db.gold_failures
    if db.gold_failures and db.check.db_match:
        not_graded[RewardType.DB] = "gold replay incomplete: a gold write failed, so a match certifies nothing"
    else:
        components[RewardType.DB] = db.check.db_reward


async def evaluate(simulation: SimulationRun, task: Task, environment_factory: EnvironmentFactory,
                   judge: ModelClient | None = None, *, strict_replay: bool = True, judge_all: bool = False,
                   judge_params: SamplingParams | None = None) -> RewardInfo:
    if simulation.task_id != task.id:
        raise ValueError(f"simulation is for task {simulation.task_id!r}, not {task.id!r}")
    sha = task.source_sha256 or simulation.task_file_sha256
    gated = termination_gate(simulation, task)
    if gated is not None:
        gated.task_file_sha256 = sha
        return gated

    basis = task.reward_basis
    messages = simulation.messages
    components: dict[RewardType, float] = {}
    not_graded: dict[RewardType, str] = {}
    info: dict = {}
    record = RewardInfo(reward=None, reward_basis=basis, task_file_sha256=sha)

    if task.evaluation_criteria is None:
        record.reward = record.partial_reward = 1.0
        record.info = {"note": "No evaluation criteria"}
        return record

    criteria = task.evaluation_criteria
    if criteria.actions is None and criteria.env_assertions is None:
        # tau2: no reference trajectory and no assertions means no DB target; the DB passes.
        record.db_check = DBCheck(db_match=True, db_reward=1.0)
        components[RewardType.DB] = components[RewardType.ENV_ASSERTION] = 1.0
        info["note"] = "No expected actions or env assertions"
        record.env_assertions = []
    else:
        db = check_db(messages, task, environment_factory, strict=strict_replay)
        _apply_db(db, record, components, not_graded, info)
        record.env_assertions, components[RewardType.ENV_ASSERTION] = check_env_assertions(db.predicted, task)
    record.communicate_checks, components[RewardType.COMMUNICATE] = check_communicate(messages, task)
    record.action_checks, components[RewardType.ACTION] = check_actions(messages, task)

    assertions = task.evaluation_criteria.nl_assertions
    if RewardType.NL_ASSERTION in basis or (judge_all and judge is not None):
        nl = await check_nl_assertions(messages, assertions, judge, judge_params)
        record.nl_assertions = nl.checks
        record.judge_usage, record.judge_model = nl.usage, nl.model
        if nl.reward is None:
            not_graded[RewardType.NL_ASSERTION] = nl.error or "not graded"
        else:
            components[RewardType.NL_ASSERTION] = nl.reward
    elif assertions:
        info["nl_assertions"] = "not run: outside the reward basis"

    breakdown = {b: components[b] for b in basis if b in components}
    partial = 1.0
    for value in breakdown.values():
        partial *= value
    record.reward_breakdown = breakdown
    record.not_graded = {b: why for b, why in not_graded.items() if b in basis}
    record.partial_reward = partial
    # A failed graded component already decides the episode (the product is 0); otherwise any
    # ungraded component leaves the reward unknown.
    record.reward = partial if (not record.not_graded or partial == 0.0) else None
    record.info = info
    return record
