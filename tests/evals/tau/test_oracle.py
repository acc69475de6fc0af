"""The gold-replay oracle on the anchors' retail train split: every task's reference
trajectory must reproduce the gold DB through the full orchestrator and evaluator."""

from __future__ import annotations

import json

import pytest

from closedloop.evals.tau import RewardType, TerminationReason, evaluate, run_episode
from closedloop.evals.tau.metrics import compute_metrics
from closedloop.evals.tau.oracle import OracleAgent, ScenarioUser
from closedloop.evals.tau.results import RunInfo, results_dict

from ._support import ScriptedClient

# Task 105's only gold write (an exchange paid by a gift card holding 17.00 for a 21.10
# difference) fails upstream too, so its gold state equals the initial DB: the DB component
# cannot certify a pass and is reported "not graded" (tau2 reports db_check=None).
GOLD_INCOMPLETE = {"105"}


def all_met_judge() -> ScriptedClient:
    def answer(messages):
        outcomes = eval(messages[-1].text.split("expectedOutcomes:")[1].strip())  # the list repr tau2 sends
        return json.dumps({"results": [{"expectedOutcome": o, "reasoning": "oracle", "metExpectation": True}
                                       for o in outcomes]})
    return ScriptedClient(answer)


@pytest.mark.slow
async def test_oracle_scores_one_on_every_train_task(anchors_retail):
    tasks = anchors_retail.load_tasks("train")
    judge = all_met_judge()
    sims, incomplete = [], set()
    for task in tasks.tasks:
        sim = await run_episode(task, OracleAgent(task), ScenarioUser(task),
                                environment_factory=anchors_retail.make_environment)
        assert sim.termination_reason == TerminationReason.USER_STOP, task.id
        info = await evaluate(sim, task, anchors_retail.make_environment, judge)
        assert info.db_check.db_match, task.id
        assert info.partial_reward == 1.0, (task.id, info.reward_breakdown)
        assert info.task_file_sha256 == tasks.sha256
        assert info.reward == 1.0, (task.id, info.not_graded)
        failed_writes = [f for f in info.gold_failures if f["mutating"]]
        if failed_writes:
            incomplete.add(task.id)
            assert failed_writes[0]["error"].startswith("Insufficient gift card balance")
            strict = await evaluate(sim, task, anchors_retail.make_environment, None, strict_gold_replay=True)
            assert strict.reward is None and RewardType.DB in strict.not_graded
        sim.reward_info = info
        sims.append(sim)
    assert incomplete == GOLD_INCOMPLETE
    assert len(judge.prompts) == sum(1 for t in tasks.tasks if t.evaluation_criteria.nl_assertions
                                     and RewardType.NL_ASSERTION in t.reward_basis)
    metrics = compute_metrics(sims)
    assert metrics.pass_hat_k[1] == 1.0 and metrics.num_tasks[1] == len(tasks)
    assert metrics.ungraded == []
    exported = json.loads(json.dumps(results_dict(sims[:2], tasks.tasks[:2], RunInfo(task_file_sha256=tasks.sha256))))
    assert exported["simulations"][0]["reward_info"]["db_check"]["db_match"] is True


async def test_oracle_without_judge_leaves_nl_tasks_ungraded(anchors_retail):
    task = next(t for t in anchors_retail.load_tasks("train").tasks if t.evaluation_criteria.nl_assertions)
    sim = await run_episode(task, OracleAgent(task), ScenarioUser(task), environment_factory=anchors_retail.make_environment)
    info = await evaluate(sim, task, anchors_retail.make_environment)
    assert info.db_check.db_match and info.reward is None and RewardType.NL_ASSERTION in info.not_graded
