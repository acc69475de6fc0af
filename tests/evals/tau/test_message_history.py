"""Tasks with a pre-filled ``message_history`` start as tau2 starts them: the history is checked,
its state-changing calls are replayed (strictly: a recorded output that the replay does not
reproduce is an error), it opens the trajectory in place of the greeting, each side sees its own
part of it, and the last message decides who acts next."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from closedloop.evals.tau import TerminationReason, evaluate, load_domain, run_episode
from closedloop.evals.tau.orchestrator import GREETING, STOP, parse_message_history
from closedloop.evals.tau.user_messages import TauUserMessage
from closedloop.messages import AssistantMessage, SystemMessage, ToolCall, ToolMessage

from ._support import CANCEL, ScriptedClient, make_task, mini_db, scripted_agent, write_root

FIXTURES = Path(__file__).parent / "fixtures"


def _cancel_output() -> str:
    """What cancelling #W1 on the mini DB returns, for a faithful recorded history."""
    root_db = mini_db()
    from closedloop.evals.tau.domains import get_domain
    from closedloop.evals.tau.environment import Environment

    domain = get_domain("retail")
    env = Environment(domain, domain.db_model.model_validate(root_db))
    return env.run_tool_call(ToolCall.make(CANCEL["name"], CANCEL["arguments"], id="c1")).text


def _history(cancel_output: str, *, last: str) -> list[dict]:
    msgs = [{"role": "user", "content": "Please cancel #W1, I no longer need it.", "turn_idx": 0},
            {"role": "assistant", "tool_calls": [{"id": "c1", "name": CANCEL["name"], "arguments": CANCEL["arguments"]}]},
            {"role": "tool", "id": "c1", "content": cancel_output}]
    if last == "agent_text":
        msgs.append({"role": "assistant", "content": "<think>ok</think>Done: #W1 is cancelled."})
    elif last == "user_text":
        msgs += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "And my refund?"}]
    return msgs


def _load(tmp_path: Path, history: list[dict]):
    task = make_task("hist", [CANCEL], basis=["DB"])
    task["initial_state"] = {"initialization_data": None, "initialization_actions": None, "message_history": history}
    data = load_domain("retail", write_root(tmp_path, mini_db(), [task]))
    return data, data.load_tasks().tasks[0]


async def test_history_ending_with_the_agents_text_goes_to_the_user(tmp_path: Path) -> None:
    data, task = _load(tmp_path, _history(_cancel_output(), last="agent_text"))
    user = ScriptedClient([f"Thanks! {STOP}"])
    sim = await run_episode(task, scripted_agent([]), user, environment_factory=data.make_environment)
    assert sim.termination_reason == TerminationReason.USER_STOP
    assert [m.role for m in sim.messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert GREETING not in json.dumps([m.text for m in sim.messages])
    # the user saw its own first message and the agent's text (reasoning stripped), roles flipped
    prompt = user.prompts[0]
    assert isinstance(prompt[0], SystemMessage)
    assert [(m.role, m.text) for m in prompt[1:]] == [("assistant", "Please cancel #W1, I no longer need it."),
                                                       ("user", "Done: #W1 is cancelled.")]
    info = await evaluate(sim, task, data.make_environment)  # the history's cancel is part of the episode
    assert info.db_check.db_match and info.reward == 1.0


async def test_history_ending_with_the_users_text_goes_to_the_agent(tmp_path: Path) -> None:
    data, task = _load(tmp_path, _history(_cancel_output(), last="user_text"))
    agent = scripted_agent([AssistantMessage(content=f"It is on its way. {STOP}")])
    sim = await run_episode(task, agent, ScriptedClient([]), environment_factory=data.make_environment)
    assert sim.termination_reason == TerminationReason.AGENT_STOP
    seen = agent.seen[0]
    assert isinstance(seen[0], SystemMessage) and seen[-1].text == "And my refund?"
    assert [m.role for m in seen[1:]] == ["user", "assistant", "tool", "assistant", "user"]


async def test_history_ending_with_a_tool_result_goes_back_to_the_agent(tmp_path: Path) -> None:
    data, task = _load(tmp_path, _history(_cancel_output(), last="tool"))
    agent = scripted_agent([AssistantMessage(content=f"Cancelled. {STOP}")])
    sim = await run_episode(task, agent, ScriptedClient([]), environment_factory=data.make_environment)
    assert sim.termination_reason == TerminationReason.AGENT_STOP and isinstance(agent.seen[0][-1], ToolMessage)
    # a call without its result is refused, as tau2's set_state refuses it
    data, task = _load(tmp_path / "b", _history(_cancel_output(), last="tool")[:2])
    with pytest.raises(ValueError, match="missing at the end"):
        await run_episode(task, agent, ScriptedClient([]), environment_factory=data.make_environment)


async def test_a_recorded_output_the_replay_does_not_give_is_refused(tmp_path: Path) -> None:
    forged = json.dumps({**json.loads(_cancel_output()), "status": "pending"})
    data, task = _load(tmp_path, _history(forged, last="agent_text"))
    with pytest.raises(ValueError, match="message_history call cancel_pending_order"):
        await run_episode(task, scripted_agent([]), ScriptedClient([]), environment_factory=data.make_environment)


@pytest.mark.parametrize("history, match", [
    ([{"role": "system", "content": "x"}], "only assistant, user and tool"),
    ([{"role": "tool", "id": "c1", "content": "x"}], "no tool call asked for"),
    ([{"role": "assistant", "tool_calls": [{"id": "c1", "name": "f", "arguments": {}}]}], "missing at the end"),
    ([{"role": "assistant", "tool_calls": [{"id": "c1", "name": "f", "arguments": {}}]},
      {"role": "user", "content": "hi"}], "missing before"),
    ([{"role": "assistant", "tool_calls": [{"id": "c1", "name": "f", "arguments": {}}]},
      {"role": "tool", "id": "c2", "content": "x"}], "expected 'c1'"),
    ([{"role": "user", "tool_calls": [{"id": "u1", "name": "f", "arguments": {}}]},
      {"role": "tool", "id": "u1", "content": "x"}], "requestor 'assistant'"),
    ([{"role": "assistant", "content": "  "}], "needs text or tool calls"),
])
def test_bad_histories_are_refused(history: list[dict], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_message_history(history, "t")


async def test_history_ending_with_the_users_own_tool_result(tmp_path: Path) -> None:
    """Telecom (dual control): after its own tool result the user goes on; the agent never sees
    the user's calls or their results."""
    data = load_domain("telecom", FIXTURES, tau2_source=False)
    task = data.load_tasks("train").tasks[0]
    env = data.make_environment()
    env.apply_initial_state(task.initial_state)
    bar = env.run_tool_call(ToolCall.make("check_status_bar", {}, id="u1"), "user").text
    history = [{"role": "assistant", "content": "Please look at your status bar."},
               {"role": "user", "content": None, "tool_calls": [{"id": "u1", "name": "check_status_bar", "arguments": {}}]},
               {"role": "tool", "id": "u1", "content": bar, "requestor": "user"}]
    state = task.initial_state.model_copy(update={"message_history": history})
    task = task.model_copy(update={"initial_state": state})
    user = ScriptedClient(["It shows no signal.", STOP])
    agent = scripted_agent([AssistantMessage(content="Let me check.")])
    sim = await run_episode(task, agent, user, environment_factory=data.make_environment)
    assert sim.termination_reason == TerminationReason.USER_STOP
    assert isinstance(sim.messages[1], TauUserMessage) and isinstance(sim.messages[2], ToolMessage)
    first = user.prompts[0]  # the user's view: the agent's text, its own call and its result
    assert [m.role for m in first[1:]] == ["user", "assistant", "tool"] and first[-1].text == bar
    assert [m.role for m in agent.seen[0][1:]] == ["assistant", "user"]  # no user tool traffic
    assert agent.seen[0][-1].text == "It shows no signal."
