"""TauGymEnv satisfies the environment protocol: seeded reset, named reward components."""

from __future__ import annotations

from closedloop.env import AgentEnvironment
from closedloop.evals.tau.gym import TauGymEnv
from closedloop.evals.tau.orchestrator import STOP
from closedloop.messages import AssistantMessage, ToolCall

from ._support import CANCEL, ScriptedClient


async def test_seeded_reset_and_reward_components(mini):
    task = mini.load_tasks(task_ids=["cancel"]).tasks[0]
    user = ScriptedClient(["Cancel #W1 please.", STOP])
    env = TauGymEnv(task, user, mini.make_environment)
    assert isinstance(env, AgentEnvironment)
    obs, info = await env.areset(seed=7)
    assert info["seed"] == 7 and info["rewards"] == {"success": 0.0}
    assert env.orchestrator.user.params.seed == 7 and env.orchestrator.seed == 7
    obs, reward, terminated, truncated, info = await env.astep(
        AssistantMessage(tool_calls=[ToolCall.make(CANCEL["name"], CANCEL["arguments"], id="c")]))
    assert info["rewards"] == {"success": 0.0} and reward == 0.0
    obs, reward, terminated, truncated, info = await env.astep(AssistantMessage(content="Cancelled; refund 10.0."))
    assert terminated and reward == 1.0 and info["rewards"] == {"success": reward}
    assert info["simulation"].seed == 7
    env.user_client = ScriptedClient(["Cancel #W1 please.", STOP])
    _, info = await env.areset()
    assert info["seed"] is None and env.orchestrator.user.params.seed is None
