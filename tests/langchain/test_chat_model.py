"""ClosedloopChatModel: the tiny model (hf:) behind LangChain's chat-model interface, inside
LangGraph's prebuilt agent, streamed, and a trajectory recorded through it trained for one SFT step."""

from __future__ import annotations

import pytest
import torch
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage
from langchain_core.tools import tool as lc_tool

from closedloop.langchain_chat import ClosedloopChatModel, trajectory_from_messages, turns_from_messages
from closedloop.langchain_tools import to_langchain_tool
from closedloop.messages import AssistantMessage, ToolCall
from closedloop.models.scripted import ScriptedClient
from closedloop.plugins import tool_registry
from closedloop.runtime.convert import turn_of


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _agent(model, tools):
    try:  # langchain>=1: create_agent; otherwise LangGraph's prebuilt agent
        from langchain.agents import create_agent

        return create_agent(model, tools)
    except ImportError:
        import warnings

        from langgraph.prebuilt import create_react_agent

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return create_react_agent(model, tools)


async def test_invoke_and_stream_carry_the_turn(tiny_client):
    llm = ClosedloopChatModel.from_client(tiny_client)
    msg = await llm.ainvoke([HumanMessage(content="Hello!")])
    turn = turn_of(msg)
    assert isinstance(msg, AIMessage) and turn is not None
    assert turn.completion_ids and len(turn.logprobs) == len(turn.completion_ids)
    assert msg.content == turn.message.text and msg.usage_metadata["output_tokens"] == len(turn.completion_ids)
    chunks = [c async for c in llm.astream([HumanMessage(content="Hello!")])]
    assert all(isinstance(c, AIMessageChunk) for c in chunks) and len(chunks) >= 2
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.content == msg.content  # greedy: the same reply, streamed
    assert turn_of(total).completion_ids == turn.completion_ids


async def test_bound_tools_reach_the_model_and_tool_calls_come_back():
    call = ToolCall.make("add", {"a": 3, "b": 4})
    client = ScriptedClient([AssistantMessage(tool_calls=[call])])
    seen = {}
    original = client.generate

    async def spy(messages, tools=None, params=None, tool_choice=None):
        seen.update(tools=tools, tool_choice=tool_choice, stop=params.stop)
        return await original(messages, tools, params, tool_choice)

    client.generate = spy
    llm = ClosedloopChatModel.from_client(client).bind_tools(list(tool_registry(["arithmetic"])), tool_choice="any")
    msg = await llm.ainvoke("3+4?", stop=["###"])
    assert msg.tool_calls == [{"name": "add", "args": {"a": 3, "b": 4}, "id": call.id, "type": "tool_call"}]
    assert {t["function"]["name"] for t in seen["tools"]} >= {"add", "multiply"}
    assert seen["tool_choice"] == "required" and seen["stop"] == ["###"]


async def test_prebuilt_agent_messages_stream_and_one_sft_step(tiny_model_path, tmp_path):
    """LangGraph's prebuilt agent over hf: (a spec), streamed with stream_mode="messages"; the
    recorded conversation becomes a trajectory whose token view trains one SFT step."""
    from closedloop.trainers.config import SFTConfig, load_config
    from closedloop.trainers.sft import train_sft

    @lc_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ClosedloopChatModel(model=f"hf:{tiny_model_path}", temperature=0.0, max_tokens=40)
    agent = _agent(llm, [add, to_langchain_tool(tool_registry(["arithmetic"]).get("multiply"))])
    chunks = []
    async for message, meta in agent.astream({"messages": [{"role": "user", "content": "What is 3 plus 4?"}]},
                                             {"recursion_limit": 8}, stream_mode="messages"):
        chunks.append((type(message).__name__, meta.get("langgraph_node")))
    assert any(kind == "AIMessageChunk" for kind, _ in chunks)
    out = await agent.ainvoke({"messages": [{"role": "user", "content": "What is 3 plus 4?"}]}, {"recursion_limit": 8})
    turns = turns_from_messages(out["messages"])
    assert turns and all(t.completion_ids for t in turns)
    traj = trajectory_from_messages(out["messages"], rewards={"success": 1.0})
    (view,) = traj.token_view(missing_logprobs="refuse")
    assert sum(view.loss_mask) == sum(len(t.completion_ids) for t in turns)
    cfg = load_config(SFTConfig, None, [f"model=hf:{tiny_model_path}", f"output_dir={tmp_path / 'out'}", "report_to=none",
                                        "save_steps=null", "torch_threads=1", "max_steps=1"])
    result = train_sft(cfg, [traj])
    assert result.step == 1 and result.n_train == 1 and result.metrics


def test_sync_invoke_and_stream_outside_and_inside_an_event_loop():
    import asyncio

    llm = ClosedloopChatModel.from_client(ScriptedClient([AssistantMessage(content="hi there")], cycle=True))
    assert llm.invoke("hello").content == "hi there"
    assert "".join(c.content for c in llm.stream("hello")) == "hi there"

    async def inside():  # a sync call from code that already runs a loop (a sync LangGraph node, a notebook)
        return llm.invoke("hello").content

    assert asyncio.run(inside()) == "hi there"
