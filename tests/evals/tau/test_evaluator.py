"""Each reward component passes and fails for the right reasons; the product over the basis."""

from __future__ import annotations

import json

import pytest

from closedloop.evals.tau import RewardType, TerminationReason, evaluate, load_domain, run_episode
from closedloop.evals.tau.data_model import Task
from closedloop.evals.tau.domains import Domain, register_domain
from closedloop.evals.tau.domains.base import TauDB, Toolkit, is_tool
from closedloop.evals.tau.orchestrator import STOP
from closedloop.messages import AssistantMessage, ToolCall, Usage

from ._support import CANCEL, LOOKUP, ScriptedClient, make_task, scripted_agent


def call(action: dict) -> AssistantMessage:
    return AssistantMessage(tool_calls=[ToolCall.make(action["name"], action["arguments"])])


DONE = AssistantMessage(content="Order #W1 is cancelled; a refund of 10.0 goes back to your gift card.")
WRONG_REASON = {"name": "cancel_pending_order", "arguments": {"order_id": "#W1", "reason": "ordered by mistake"}}
EXTRA = {"name": "modify_user_address", "arguments": {"user_id": "ada_1", "address1": "2 Elm St", "address2": "",
                                                      "city": "Springfield", "state": "IL", "country": "USA", "zip": "60602"}}


async def grade(data, task_id: str, outputs: list[AssistantMessage], judge=None, **kw):
    task = data.load_tasks(task_ids=[task_id]).tasks[0]
    user = ScriptedClient(["Please cancel order #W1.", STOP])
    sim = await run_episode(task, scripted_agent(outputs), user, environment_factory=data.make_environment, **kw)
    return sim, await evaluate(sim, task, data.make_environment, judge)


async def test_correct_episode_scores_one(mini):
    sim, info = await grade(mini, "cancel", [call(LOOKUP), call(CANCEL), DONE])
    assert sim.termination_reason == TerminationReason.USER_STOP
    assert info.reward == 1.0 and info.db_check.db_match
    assert info.reward_breakdown == {RewardType.DB: 1.0, RewardType.COMMUNICATE: 1.0}
    assert info.task_file_sha256 and len(info.task_file_sha256) == 64
    assert info.reward_basis == [RewardType.DB, RewardType.COMMUNICATE]


@pytest.mark.parametrize("outputs", [
    [call(LOOKUP), call(WRONG_REASON), DONE],              # wrong write
    [call(LOOKUP), DONE],                                   # missing write
    [call(LOOKUP), call(CANCEL), call(EXTRA), DONE],        # extra write
], ids=["wrong", "missing", "extra"])
async def test_db_errors_score_zero(mini, outputs):
    _, info = await grade(mini, "cancel", outputs)
    assert info.reward == 0.0 and not info.db_check.db_match
    assert info.db_check.gold_hash != info.db_check.predicted_hash
    assert info.reward_breakdown[RewardType.COMMUNICATE] == 1.0  # only the DB failed


async def test_read_only_detours_do_not_matter(mini):
    detour = {"name": "get_user_details", "arguments": {"user_id": "ada_1"}}
    _, info = await grade(mini, "cancel", [call(detour), call(CANCEL), call(LOOKUP), DONE])
    assert info.reward == 1.0


async def test_communicate_fails_when_not_said(mini):
    _, info = await grade(mini, "cancel", [call(LOOKUP), call(CANCEL), AssistantMessage(content="All done.")])
    assert info.db_check.db_match and info.reward == 0.0
    assert [c.met for c in info.communicate_checks] == [False]


async def test_action_component(mini):
    _, good = await grade(mini, "cancel_action", [call(CANCEL), DONE])
    assert good.reward == 1.0 and good.action_checks[0].action_match
    _, bad = await grade(mini, "cancel_action", [call(WRONG_REASON), DONE])
    assert bad.reward == 0.0 and not bad.action_checks[0].action_match


class VerdictJudge(ScriptedClient):
    def __init__(self, met: bool | None):
        def answer(messages):
            prompt = messages[-1].text
            assert "expectedOutcomes" in prompt and "assistant: Order #W1 is cancelled" in prompt
            if met is None:
                return "I think it went fine."
            return "```json\n" + json.dumps({"results": [{"expectedOutcome": "Agent cancels order #W1.",
                                                          "reasoning": "seen", "metExpectation": met}]}) + "\n```"
        super().__init__(answer, usage=Usage(prompt_tokens=120, completion_tokens=30, cost_usd=0.002))


async def test_nl_assertions_not_graded_without_judge(mini):
    _, info = await grade(mini, "cancel_nl", [call(CANCEL), DONE])
    assert info.db_check.db_match and info.partial_reward == 1.0
    assert info.reward is None and RewardType.NL_ASSERTION in info.not_graded
    assert "no judge" in info.not_graded[RewardType.NL_ASSERTION]


@pytest.mark.parametrize("met,expected", [(True, 1.0), (False, 0.0)])
async def test_nl_assertions_with_judge(mini, met, expected):
    _, info = await grade(mini, "cancel_nl", [call(CANCEL), DONE], judge=VerdictJudge(met))
    assert info.reward == expected and info.nl_assertions[0].met is met
    assert info.judge_usage.total_tokens == 150 and info.judge_usage.cost_usd == pytest.approx(0.002)


async def test_unreadable_judge_is_not_a_pass(mini):
    _, info = await grade(mini, "cancel_nl", [call(CANCEL), DONE], judge=VerdictJudge(None))
    assert info.reward is None and "unreadable" in info.not_graded[RewardType.NL_ASSERTION]


async def test_termination_gate(mini):
    # the agent does everything right but the user never stops: max_steps scores 0
    task = mini.load_tasks(task_ids=["cancel"]).tasks[0]
    user = ScriptedClient(lambda msgs: "Anything else?")
    agent = scripted_agent([call(LOOKUP), call(CANCEL)] + [DONE] * 10)
    sim = await run_episode(task, agent, user, environment_factory=mini.make_environment, max_steps=8)
    info = await evaluate(sim, task, mini.make_environment)
    assert sim.termination_reason == TerminationReason.MAX_STEPS and info.reward == 0.0
    assert info.db_check is None and "prematurely" in info.info["note"]


class FlagDB(TauDB):
    flags: dict[str, bool] = {}


class FlagTools(Toolkit):
    db: FlagDB

    @is_tool(mutates=True, kind="write")
    def set_flag(self, name: str, value: bool) -> str:
        """Set a flag.

        Args:
            name: Flag name.
            value: New value.
        """
        self.db.flags[name] = value
        return "ok"

    def assert_flag(self, name: str) -> bool:
        return self.db.flags.get(name, False)


@pytest.mark.parametrize("value,expected", [(True, 1.0), (False, 0.0)])
async def test_env_assertion(tmp_path, value, expected):
    register_domain(Domain(name="flags_test", db_model=FlagDB, toolkit=FlagTools), replace=True)
    folder = tmp_path / "tau2" / "domains" / "flags_test"
    folder.mkdir(parents=True)
    (folder / "db.json").write_text('{"flags": {}}')
    task = make_task("flag", [], basis=["ENV_ASSERTION"],
                     env_assertions=[{"env_type": "assistant", "func_name": "assert_flag", "arguments": {"name": "on"},
                                      "assert_value": True}])
    (folder / "tasks.json").write_text(json.dumps([task]))
    data = load_domain("flags_test", tmp_path)
    set_flag = AssistantMessage(tool_calls=[ToolCall.make("set_flag", {"name": "on", "value": value})])
    _, info = await grade(data, "flag", [set_flag, AssistantMessage(content="done")])
    assert info.reward == expected and info.env_assertions[0].met is bool(value)
    assert info.reward_breakdown == {RewardType.ENV_ASSERTION: expected}


def test_task_schema_matching_rules():
    task = Task.model_validate(make_task("t", [{"name": "transfer_to_human_agents", "arguments": {"summary": "x"},
                                                 "compare_args": []}, LOOKUP]))
    transfer, lookup = task.evaluation_criteria.actions
    assert transfer.matches("transfer_to_human_agents", {"summary": "anything"})  # [] = name only
    assert lookup.matches("get_order_details", {"order_id": "#W1"})
    assert not lookup.matches("get_order_details", {"order_id": "#W2"})


async def test_judge_failure_is_not_a_pass(mini):
    class DownJudge(ScriptedClient):
        async def generate(self, *a, **k):
            raise ConnectionError("judge unreachable")

    _, info = await grade(mini, "cancel_nl", [call(CANCEL), DONE], judge=DownJudge([]))
    assert info.reward is None and "judge call failed" in info.not_graded[RewardType.NL_ASSERTION]


async def test_gold_replay_is_cached_across_trials(mini):
    class CountingFactory:
        def __init__(self):
            self.calls = 0
            self.cache_key = mini.cache_key

        def __call__(self):
            self.calls += 1
            return mini.make_environment()

    task = mini.load_tasks(task_ids=["cancel"]).tasks[0]
    factory = CountingFactory()
    infos = []
    for outputs in ([call(LOOKUP), call(CANCEL), DONE], [call(LOOKUP), DONE]):
        sim = await run_episode(task, scripted_agent(outputs), ScriptedClient(["Cancel #W1.", STOP]),
                                environment=mini.make_environment())
        infos.append(await evaluate(sim, task, factory))
    assert factory.calls == 3  # two predicted replays, one gold replay
    assert [i.reward for i in infos] == [1.0, 0.0]
    assert infos[0].db_check.gold_hash == infos[1].db_check.gold_hash == infos[0].db_check.predicted_hash
