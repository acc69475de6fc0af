"""Clarification-enhanced tasks: what is withheld, determinism under a seed, and that the withheld
detail is recoverable by asking (the oracle still reaches the gold DB)."""

from __future__ import annotations

import asyncio

from closedloop.evals.tau.clarify import (ClarifyingScenarioUser, candidate_slots, clarification_of,
                                          make_clarification_tasks)
from closedloop.evals.tau.data_model import StructuredUserInstructions
from closedloop.evals.tau.evaluator import evaluate
from closedloop.evals.tau.oracle import OracleAgent
from closedloop.evals.tau.orchestrator import STOP, run_episode
from closedloop.messages import AssistantMessage, UserMessage


def test_transform_is_deterministic_and_records_the_goal(anchors_retail):
    tasks = anchors_retail.load_tasks("train").tasks
    a = make_clarification_tasks(tasks, seed=7)
    b = make_clarification_tasks(tasks, seed=7)
    assert [t.model_dump() for t in a] == [t.model_dump() for t in b]
    assert len(a) == sum(1 for t in tasks if candidate_slots(t))
    c = make_clarification_tasks(tasks, seed=8)
    assert [t.id for t in a] != [t.id for t in c] or [clarification_of(t).value for t in a] != \
        [clarification_of(t).value for t in c]
    for task in a:
        info = clarification_of(task)
        assert task.id == f"{info.original_task_id}[clarify:{info.slot}]"
        instr = task.user_scenario.instructions
        assert isinstance(instr, StructuredUserInstructions)
        assert info.value in instr.task_instructions  # the simulated user knows it ...
        if info.slot == "order":
            assert info.value not in instr.reason_for_call  # ... but does not open with it
            assert info.value in info.goal
    assert {clarification_of(t).slot for t in a} == {"order", "payment"}


def test_keep_unclarifiable_keeps_every_task(anchors_retail):
    tasks = anchors_retail.load_tasks("train").tasks
    kept = make_clarification_tasks(tasks, seed=0, keep_unclarifiable=True)
    assert len(kept) == len(tasks)
    assert any(clarification_of(t) is None for t in kept)


def test_scenario_user_reveals_the_detail_only_when_asked(anchors_retail):
    task = next(t for t in make_clarification_tasks(anchors_retail.load_tasks("train").tasks, seed=0)
                if clarification_of(t).slot == "order")
    info = clarification_of(task)

    async def talk():
        user = ClarifyingScenarioUser(task)
        opening = (await user.generate([AssistantMessage(content="Hi! How can I help you today?")])).message.text
        answer = (await user.generate([UserMessage(content="Which order do you mean?")])).message.text
        done = (await user.generate([UserMessage(content="Done.")])).message.text
        return opening, answer, done

    opening, answer, done = asyncio.run(talk())
    assert info.value not in opening and info.value in answer and done == STOP


def test_oracle_solves_clarified_tasks(anchors_retail):
    tasks = make_clarification_tasks(anchors_retail.load_tasks("train").tasks[:6], seed=0)
    for task in tasks:
        sim = asyncio.run(run_episode(task, OracleAgent(task), ClarifyingScenarioUser(task),
                                      environment_factory=anchors_retail.make_environment))
        info = asyncio.run(evaluate(sim, task, anchors_retail.make_environment, judge=None))
        assert info.db_check is not None and info.db_check.db_match
