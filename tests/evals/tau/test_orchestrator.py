"""Orchestrator termination paths, routing rules, reasoning stripping, gym API, export."""

from __future__ import annotations

import json

import pytest

from closedloop.evals.tau import TerminationReason, run_episode
from closedloop.evals.tau.gym import TauGymEnv
from closedloop.evals.tau.orchestrator import GREETING, STOP, TRANSFER
from closedloop.evals.tau.results import RunInfo, write_results
from closedloop.messages import AssistantMessage, SystemMessage, ToolCall, ToolMessage, Turn, Usage, UserMessage
from closedloop.models.base import ModelUnavailableError

from ._support import CANCEL, LOOKUP, ScriptedClient, scripted_agent


def call(action: dict) -> AssistantMessage:
    return AssistantMessage(tool_calls=[ToolCall.make(action["name"], action["arguments"])])


async def episode(mini, agent, user, task_id="cancel", **kw):
    task = mini.load_tasks(task_ids=[task_id]).tasks[0]
    return await run_episode(task, agent, user, environment_factory=mini.make_environment, **kw)


async def test_user_stop_and_what_each_side_sees(mini):
    user = ScriptedClient(["Cancel #W1 please.", f"Thanks! {TRANSFER}"])
    agent = scripted_agent([call(LOOKUP), AssistantMessage(content="<think>secret plan</think>It is pending.",
                                                           reasoning="more secrets")])
    sim = await episode(mini, agent, user)
    assert sim.termination_reason == TerminationReason.USER_STOP and sim.stop_token == TRANSFER
    assert [m.role for m in sim.messages] == ["assistant", "user", "assistant", "tool", "assistant", "user"]
    assert sim.messages[0].text == GREETING and sim.steps == 5
    first_prompt = user.prompts[0]
    assert isinstance(first_prompt[0], SystemMessage) and "<scenario>" in first_prompt[0].text
    assert "I want to cancel order #W1." in first_prompt[0].text
    # the user saw the greeting, then only the agent's text with reasoning stripped, never tool traffic
    second = user.prompts[1]
    assert [m.role for m in second[1:]] == ["user", "assistant", "user"]
    assert second[-1].text == "It is pending." and "secret" not in json.dumps([m.text for m in second])
    # the agent saw its system prompt with the policy and the tool result
    seen = agent.seen[1]
    assert isinstance(seen[0], SystemMessage) and "<policy>" in seen[0].text and "Be helpful." in seen[0].text
    assert isinstance(seen[-1], ToolMessage) and json.loads(seen[-1].text)["order_id"] == "#W1"


async def test_an_episode_takes_exactly_one_environment_source(mini):
    task = mini.load_tasks(task_ids=["cancel"]).tasks[0]
    agent, user = scripted_agent([]), ScriptedClient(["Hi"])
    with pytest.raises(ValueError, match="exactly one of environment or environment_factory"):
        await run_episode(task, agent, user)
    with pytest.raises(ValueError, match="exactly one of environment or environment_factory"):
        await run_episode(task, agent, user, environment=mini.make_environment(),
                          environment_factory=mini.make_environment)


async def test_agent_stop(mini):
    sim = await episode(mini, scripted_agent([AssistantMessage(content=f"Bye {STOP}")]), ScriptedClient(["Hi"]))
    assert sim.termination_reason == TerminationReason.AGENT_STOP


async def test_max_steps(mini):
    user = ScriptedClient(lambda msgs: "Go on.")
    sim = await episode(mini, scripted_agent([call(LOOKUP)] * 20), user, max_steps=6)
    # step 6 is an agent tool call: its result (step 7) is delivered before the limit applies, as in tau2
    assert sim.termination_reason == TerminationReason.MAX_STEPS and sim.steps == 7
    assert isinstance(sim.messages[-1], ToolMessage)  # a pending tool result is delivered before stopping


async def test_too_many_errors(mini):
    bad = {"name": "get_order_details", "arguments": {"order_id": "nope"}}
    sim = await episode(mini, scripted_agent([call(bad)] * 5), ScriptedClient(["Hi"]), max_errors=3)
    assert sim.termination_reason == TerminationReason.TOO_MANY_ERRORS and sim.num_tool_errors == 3
    assert all(m.text == "Error: Order not found" for m in sim.messages if isinstance(m, ToolMessage))


async def test_text_and_tool_calls_in_one_message(mini):
    both = AssistantMessage(content="Let me look that up.", tool_calls=[ToolCall.make(LOOKUP["name"], LOOKUP["arguments"])])
    # default (tau2): the calls run, the text never reaches the user
    user = ScriptedClient(["Cancel #W1.", STOP])
    sim = await episode(mini, scripted_agent([both, AssistantMessage(content="Found it.")]), user)
    assert sim.termination_reason == TerminationReason.USER_STOP
    assert isinstance(sim.messages[3], ToolMessage) and user.prompts[1][-1].text == "Found it."
    # strict mode: protocol violation
    sim = await episode(mini, scripted_agent([both]), ScriptedClient(["Cancel #W1."]), validate_communication=True)
    assert sim.termination_reason == TerminationReason.AGENT_ERROR and "both" in sim.error


async def test_agent_failures(mini):
    async def down(messages, tools):
        raise ModelUnavailableError("connection refused")

    sim = await episode(mini, down, ScriptedClient(["Hi"]))
    assert sim.termination_reason == TerminationReason.INFRASTRUCTURE_ERROR and "refused" in sim.error
    sim = await episode(mini, scripted_agent([AssistantMessage(content="  ")]), ScriptedClient(["Hi"]))
    assert sim.termination_reason == TerminationReason.AGENT_ERROR and "empty" in sim.error


async def test_turns_are_recorded(mini):
    turn = Turn(message=AssistantMessage(content=f"done {STOP}"), model="m", prompt_ids=[1, 2], completion_ids=[3],
                usage=Usage(prompt_tokens=2, completion_tokens=1, cost_usd=0.01))
    sim = await episode(mini, scripted_agent([turn]), ScriptedClient(["Hi"], usage=Usage(prompt_tokens=5, cost_usd=0.5)))
    assert sim.agent_turns[0].completion_ids == [3] and sim.agent_cost == 0.01 and sim.user_cost == 0.5
    assert json.loads(sim.model_dump_json())["termination_reason"] == "agent_stop"
    again = type(sim).model_validate_json(sim.model_dump_json())
    assert again == sim and isinstance(again.messages[1], UserMessage)


def test_gym_reset_step(mini):
    task = mini.load_tasks(task_ids=["cancel"]).tasks[0]
    env = TauGymEnv(task, ScriptedClient(["Cancel #W1 please.", STOP]), mini.make_environment)
    obs, info = env.reset()
    assert [m.role for m in obs] == ["system", "assistant", "user"] and obs[-1].text == "Cancel #W1 please."
    assert "cancel_pending_order" in {t["function"]["name"] for t in info["tools"]}
    obs, reward, terminated, truncated, info = env.step(json.dumps(LOOKUP))
    assert reward == 0.0 and not terminated and isinstance(obs[-1], ToolMessage)
    obs, reward, terminated, truncated, info = env.step(call(CANCEL))
    assert not terminated
    obs, reward, terminated, truncated, info = env.step("Cancelled; refund of 10.0 issued.")
    assert terminated and not truncated and reward == 1.0 and info["graded"]
    assert info["reward_info"].db_check.db_match
    # a second episode starts from a pristine DB
    env.user_client = ScriptedClient(["Cancel #W1 please.", STOP])
    env.reset()
    *_, info = env.step("Nothing to do.")
    assert info["reward"] == 0.0 and not info["reward_info"].db_check.db_match
    env.close()


async def test_results_export(mini, tmp_path):
    sim = await episode(mini, scripted_agent([call(LOOKUP), AssistantMessage(content="ok")]),
                        ScriptedClient(["Hi", STOP]))
    tasks = mini.load_tasks("train")
    path = write_results(tmp_path / "results.json", [sim], tasks.tasks, RunInfo(task_file_sha256=tasks.sha256))
    data = json.loads(path.read_text())
    assert set(data) == {"timestamp", "info", "tasks", "simulations"}
    assert data["info"]["task_file_sha256"] == tasks.sha256
    s = data["simulations"][0]
    assert s["termination_reason"] == "user_stop" and s["task_file_sha256"] == tasks.sha256
    tool_call = s["messages"][2]["tool_calls"][0]
    assert tool_call["arguments"] == {"order_id": "#W1"} and tool_call["requestor"] == "assistant"
    assert s["messages"][3]["role"] == "tool" and s["messages"][3]["error"] is False
    assert data["tasks"][0]["id"] == "cancel" and "annotations" not in data["tasks"][0]
