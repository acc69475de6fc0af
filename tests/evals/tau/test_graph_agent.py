"""A graph as a τ agent: each call runs on the agent's whole view of the conversation, and the
agent's state between calls is the graph's ``scratch`` (tau2's explicit agent state), so the
clarifier asks once per episode however the orchestrator's history grows."""

from __future__ import annotations

from closedloop.agents.clarifier.scorer import GoalScorer
from closedloop.evals.tau.agents import graph_agent
from closedloop.messages import AssistantMessage, SystemMessage, Turn, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.runtime import context_for, load_graph
from closedloop.tool import tool

GOALS = ["return the kettle.", "return the lamp.", "return the watch."]


@tool
def find_order(item: str) -> str:
    """Find the order holding an item.

    Args:
        item: What was bought.
    """
    return "order 7"


async def test_the_agent_state_is_the_graphs_scratch_and_each_call_sees_the_whole_view(scorer_model_path):
    offered: list[list[str]] = []

    class Policy(ScriptedClient):
        async def generate(self, messages, tools=None, params=None, tool_choice=None):
            offered.append([t["function"]["name"] for t in tools or []])
            return await super().generate(messages, tools, params, tool_choice)

    policy = Policy([AssistantMessage(content="Which item would you like to return?"),
                     AssistantMessage(content="I have started the return.")])
    graph = load_graph("clarifier")
    context = context_for(graph, client=policy, scorer=GoalScorer.from_pretrained(scorer_model_path),
                          candidates=lambda messages: GOALS, threshold=0.0, system_prompt=None, execute_tools=False)
    agent = graph_agent(graph, context)
    view = [SystemMessage(content="the policy"), UserMessage(content="I want to return an item.")]
    first = await agent(view, [find_order])
    assert isinstance(first, Turn) and first.message.text.endswith("?")  # the question, token record and all
    view += [first.message, UserMessage(content="The lamp.")]
    second = await agent(view, [find_order])
    assert isinstance(second, Turn) and second.message.text == "I have started the return."  # asked once only
    # the second call ran on the whole view, in order, nothing sent twice; the episode's tools were offered
    assert [m.role for m in policy.calls[1]] == ["system", "user", "assistant", "user"]
    assert policy.calls[1][0].content == "the policy" and policy.calls[1][2].content == first.message.text
    assert offered == [[], ["find_order"]]  # the question offers no tools; the policy's turn does
    # a new episode starts from fresh state: it asks again
    fresh = ScriptedClient([AssistantMessage(content="Which one?")])
    again = await graph_agent(graph, context.model_copy(update={"client": fresh}))(view[:2], [find_order])
    assert isinstance(again, Turn) and again.message.text == "Which one?"
