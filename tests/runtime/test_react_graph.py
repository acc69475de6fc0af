"""The react graph with a scripted model: control flow, error handling, approvals, checkpoints.

A scripted model is used here on purpose (control flow only); the same graph runs against the
real tiny model behind a real HTTP server in tests/test_end_to_end.py.
"""

import uuid

from langgraph.types import Command

from langchain_core.messages import AIMessage

from closedloop.graphs.react import graph
from closedloop.messages import AssistantMessage, SystemMessage, ToolCall, ToolMessage, Turn, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.plugins import tool_registry
from closedloop.runtime import AgentContext, make_checkpointer, with_checkpointer
from closedloop.runtime.convert import role_of
from closedloop.runtime.execute import run_graph


def _ctx(client, **settings):
    return AgentContext(client=client, tools=tool_registry(["arithmetic"]), **settings)


def _calc_script(*args_list):
    return [AssistantMessage(tool_calls=[ToolCall.make("add", a)]) for a in args_list] + [AssistantMessage(content="done")]


async def test_tool_round_trip_records_turns_and_tool_records():
    client = ScriptedClient(_calc_script({"a": 3, "b": 4}))
    out = await graph.ainvoke({"messages": [UserMessage(content="3+4?")]}, context=_ctx(client, system_prompt="be brief"))
    roles = [role_of(m) for m in out["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert out["messages"][2].content == "7.0"
    assert len(out["turns"]) == 2 and out["tool_records"][0].turn_idx == 0
    # the system prompt is sent to the model but not stored twice in the state
    assert isinstance(client.calls[0][0], SystemMessage) and client.calls[0][0].content == "be brief"
    assert isinstance(client.calls[1][-1], ToolMessage)


async def test_bad_tool_calls_go_back_to_the_model_and_the_run_continues():
    script = [AssistantMessage(tool_calls=[ToolCall.make("add", '{"a": 1'), ToolCall.make("add", {"a": "x", "b": 1}),
                                           ToolCall.make("nosuch", {})]),
              AssistantMessage(content="sorry")]
    client = ScriptedClient(script)
    out = await graph.ainvoke({"messages": [UserMessage(content="go")]}, context=_ctx(client))
    kinds = [r.error_kind for r in out["tool_records"]]
    assert kinds == ["malformed_json", "invalid_arguments", "unknown_tool"]
    seen_by_model = client.calls[1][-3:]
    assert all(isinstance(m, ToolMessage) and m.content.startswith("Error:") for m in seen_by_model)
    assert out["messages"][-1].content == "sorry"


async def test_max_turns_stops_a_looping_model():
    client = ScriptedClient([AssistantMessage(tool_calls=[ToolCall.make("add", {"a": 1, "b": 1})])], cycle=True)
    out = await graph.ainvoke({"messages": [UserMessage(content="loop")]}, context=_ctx(client, max_turns=3))
    assert len(out["turns"]) == 3 and len(client.calls) == 3


async def test_approval_interrupt_survives_a_restart_with_sqlite(tmp_path):
    """Pause on approval, drop everything, rebuild from the SQLite file, resume by thread id."""
    db = tmp_path / "ck.sqlite"
    thread = {"configurable": {"thread_id": uuid.uuid4().hex}}
    script = _calc_script({"a": 2, "b": 5})
    async with make_checkpointer("sqlite", db) as saver:
        first = await run_graph(with_checkpointer(graph, saver), {"messages": [UserMessage(content="2+5?")]},
                                config=thread, context=_ctx(ScriptedClient(script), approve=["add"]))
    assert first.paused and first.interrupts[0]["action_requests"][0]["name"] == "add"
    assert not first.state.get("tool_records")  # nothing ran before approval

    # a new process: new client (continuing the script), new saver on the same file
    client = ScriptedClient(script[1:])
    async with make_checkpointer("sqlite", db) as saver:
        resumed = with_checkpointer(graph, saver)
        state = await resumed.aget_state(thread)
        assert isinstance(state.values["messages"][-1], AIMessage)  # typed objects revived
        assert isinstance(state.values["turns"][-1], Turn)
        done = await run_graph(resumed, Command(resume=True), config=thread, context=_ctx(client, approve=["add"]))
    assert not done.paused
    assert [role_of(m) for m in done.state["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert done.state["messages"][2].content == "7.0"


async def test_rejected_call_is_reported_to_the_model():
    saver = make_checkpointer("memory")
    thread = {"configurable": {"thread_id": "t"}}
    client = ScriptedClient(_calc_script({"a": 1, "b": 1}))
    kept, ctx = with_checkpointer(graph, saver), _ctx(client, approve=True)
    paused = await run_graph(kept, {"messages": [UserMessage(content="1+1")]}, config=thread, context=ctx)
    assert paused.paused
    done = await run_graph(kept, Command(resume={"approve": False, "reason": "not now"}), config=thread, context=ctx)
    rec = done.state["tool_records"][0]
    assert rec.error_kind == "rejected" and "not now" in rec.content


async def test_streamed_tokens_and_recorder_see_every_step():
    events, recorded = [], []

    class Rec:
        def record(self, messages, turns, tool_records):
            recorded.append((len(messages), len(turns), len(tool_records)))

    client = ScriptedClient(_calc_script({"a": 1, "b": 2}))
    result = await run_graph(graph, {"messages": [UserMessage(content="1+2")]}, context=_ctx(client, stream_tokens=True),
                             on_event=events.append, recorder=Rec())
    assert ("token", "done") in events
    assert recorded == [(1, 0, 0), (1, 1, 0), (1, 0, 1), (1, 1, 0)]  # input, model, tools, model
    assert result.state["messages"][-1].content == "done"


async def test_max_turns_counts_only_the_model_calls_of_this_invocation():
    from langgraph.runtime import Runtime

    from closedloop.runtime.nodes import route_after_tools

    call = AssistantMessage(tool_calls=[ToolCall.make("add", {"a": 1, "b": 2})])
    result = ToolMessage(tool_call_id=call.tool_calls[0].id, content="3")
    runtime = Runtime(context=AgentContext(max_turns=2))
    earlier = [UserMessage(content="a"), call, result, call, result, AssistantMessage(content="3")]
    # two model calls in an earlier invocation do not count against this one
    assert await route_after_tools({"messages": earlier + [UserMessage(content="b"), call, result]}, runtime) == "model"
    assert await route_after_tools({"messages": earlier + [UserMessage(content="b"), call, result, call, result]},
                                   runtime) == "__end__"


async def test_one_compiled_graph_serves_many_clients_and_tool_sets_at_once():
    """The graph binds nothing: concurrent runs with different clients, tools and budgets each see
    their own, and a JSON context (what a server sends) names the tools by module."""
    import asyncio

    a = ScriptedClient(_calc_script({"a": 1, "b": 2}))
    b = ScriptedClient([AssistantMessage(content="no tools here")])
    outs = await asyncio.gather(
        graph.ainvoke({"messages": [UserMessage(content="1+2")]}, context=_ctx(a)),
        graph.ainvoke({"messages": [UserMessage(content="hi")]}, context=AgentContext(client=b, system_prompt=None)))
    assert outs[0]["tool_records"][0].content == "3.0" and outs[1]["messages"][-1].content == "no tools here"
    assert a.calls[0][0].content.startswith("You are a helpful assistant") and b.calls[0][0].role == "user"
    assert b.calls and not outs[1].get("tool_records")
    c = ScriptedClient(_calc_script({"a": 2, "b": 2}))
    out = await graph.ainvoke({"messages": [("user", "2+2")]}, context={"client": c, "tools": "arithmetic"})
    assert out["tool_records"][0].content == "4.0"


async def test_a_run_without_a_model_says_what_to_set(monkeypatch):
    import pytest

    monkeypatch.delenv("CLOSEDLOOP_MODEL", raising=False)
    with pytest.raises(ValueError, match="no model chosen: set the run context's model"):
        await graph.ainvoke({"messages": [UserMessage(content="hi")]})
