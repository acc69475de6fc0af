"""One message form per thread (LangChain's, whatever form the caller sends: ours, LangChain's,
OpenAI dicts), LangGraph's prebuilt parts on our state, stream_mode="messages", approvals in
LangChain's HITL shape, the serializer allowlist for a checkpointer we did not configure, and
max_turns per invocation. Real compiled graphs; the model is scripted (control flow only)."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, RemoveMessage
from langchain_core.messages import ToolMessage as LCToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.event_hooks import register_serde_event_listener
from langgraph.graph import START, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command

from closedloop.graphs.react import graph
from closedloop.langchain_tools import to_langchain_tool
from closedloop.messages import AssistantMessage, ToolCall, ToolMessage, Turn, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.plugins import tool_registry
from closedloop.runtime import AgentContext, AgentState, model_node, with_checkpointer
from closedloop.runtime.convert import add_any_messages, as_closedloop, to_closedloop, to_langchain, turn_of


def _ctx(client, tools=("arithmetic",), **settings):
    return AgentContext(client=client, tools=list(tools), **settings)


def _script(*args):
    return [AssistantMessage(tool_calls=[ToolCall.make("add", a)]) for a in args] + [AssistantMessage(content="done")]


def _valid_openai_conversation(messages) -> None:
    """Every tool call is answered by a tool message before the next user/assistant message."""
    open_calls: set[str] = set()
    for m in (to_closedloop(x) for x in messages):
        if m.role == "tool":
            assert m.tool_call_id in open_calls, f"tool message for unknown call {m.tool_call_id}"
            open_calls.discard(m.tool_call_id)
            continue
        assert not open_calls, f"calls {open_calls} left without a result before a {m.role} message"
        if m.role == "assistant" and m.tool_calls:
            open_calls = {c.id for c in m.tool_calls}
    assert not open_calls


@pytest.mark.parametrize("form", ["closedloop", "langchain", "openai", "studio"])
async def test_one_form_per_thread_whatever_the_caller_sends(form):
    user = {"closedloop": UserMessage(content="3+4?"), "langchain": HumanMessage(content="3+4?"),
            "openai": {"role": "user", "content": "3+4?"}, "studio": {"type": "human", "content": "3+4?"}}[form]
    client = ScriptedClient(_script({"a": 3, "b": 4}))
    out = await graph.ainvoke({"messages": [user]}, context=_ctx(client))
    msgs = out["messages"]
    assert [type(m) for m in msgs] == [HumanMessage, AIMessage, LCToolMessage, AIMessage]  # LangChain's, always
    assert all(m.id for m in msgs) and msgs[2].content == "7.0"
    # the model always saw our typed messages; the turns stay ours; each AIMessage carries its turn
    assert isinstance(client.calls[1][-1], ToolMessage) and all(isinstance(t, Turn) for t in out["turns"])
    assert turn_of(msgs[1]) == out["turns"][0] and turn_of(msgs[3]) == out["turns"][1]
    # the exact argument string the model emitted survives the form
    assert as_closedloop(msgs)[1].tool_calls[0].function.arguments == json.dumps({"a": 3, "b": 4})


def test_reducer_is_add_messages_over_langchain_messages():
    left = add_any_messages([], [{"type": "human", "content": "hi", "id": "1"}])  # Studio's shape
    assert isinstance(left[0], HumanMessage)
    left = add_any_messages(left, [UserMessage(content="again")])
    assert isinstance(left[1], HumanMessage) and left[1].id
    replaced = add_any_messages(left, [HumanMessage(content="edited", id="1")])
    assert [m.content for m in replaced] == ["edited", "again"]
    assert add_any_messages(replaced, [RemoveMessage(id="1")])[0].content == "again"
    assert add_any_messages(replaced, [RemoveMessage(id=REMOVE_ALL_MESSAGES), UserMessage(content="c")])[0].content == "c"
    mixed = add_any_messages([UserMessage(content="a")], {"role": "assistant", "content": "b"})  # a thread saved in ours
    assert [type(m) for m in mixed] == [HumanMessage, AIMessage]
    with pytest.raises(TypeError, match="not a chat message"):
        add_any_messages(mixed, [42])


def test_conversion_keeps_malformed_arguments_and_tool_errors():
    call = ToolCall.make("add", '{"a": 1')
    ai = to_langchain(AssistantMessage(tool_calls=[call]))
    assert ai.invalid_tool_calls[0]["args"] == '{"a": 1' and not ai.tool_calls
    assert to_closedloop(ai).tool_calls[0].function.arguments == '{"a": 1'
    err = to_langchain(ToolMessage(tool_call_id="c", content="Error: boom", error="boom"))
    assert err.status == "error" and to_closedloop(err).error == "boom"


async def test_prebuilt_tool_node_and_tools_condition_on_our_state():
    """A LangGraph user's own graph: our model node, LangGraph's ToolNode and tools_condition."""
    tools = tool_registry(["arithmetic"])
    builder = StateGraph(AgentState, context_schema=AgentContext)
    builder.add_node("model", model_node)
    builder.add_node("tools", ToolNode([to_langchain_tool(t) for t in tools]))
    builder.add_edge(START, "model")
    builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    out = await builder.compile().ainvoke({"messages": [{"type": "human", "content": "2+5?"}]},
                                          context=AgentContext(client=ScriptedClient(_script({"a": 2, "b": 5})),
                                                               tools=tools))
    assert isinstance(out["messages"][2], LCToolMessage) and out["messages"][2].content == "7.0"
    assert out["messages"][-1].content == "done" and len(out["turns"]) == 2


async def test_stream_mode_messages_yields_tokens_and_tool_messages():
    client = ScriptedClient(_script({"a": 1, "b": 2}))
    seen = []
    async for message, meta in graph.astream({"messages": [HumanMessage(content="1+2")]}, stream_mode="messages",
                                             context=_ctx(client)):
        seen.append((type(message).__name__, meta["langgraph_node"], message.content))
    assert ("AIMessageChunk", "model", "done") in seen
    assert ("ToolMessage", "tools", "3.0") in seen
    # our own form streams the model's tokens too
    seen = [m async for m, _ in graph.astream({"messages": [UserMessage(content="hi")]}, stream_mode="messages",
                                              context=_ctx(ScriptedClient(_script()), tools=()))]
    assert isinstance(seen[0], AIMessageChunk) and seen[0].content == "done"


async def test_a_callers_callbacks_see_the_model_call_as_a_chat_model_run():
    """Without any callback handler the node calls the model directly; with one (a tracer, the
    caller's own) the call is reported to it as LangChain reports a chat model's."""
    from langchain_core.callbacks import AsyncCallbackHandler

    class Seen(AsyncCallbackHandler):
        def __init__(self):
            self.events = []

        async def on_chat_model_start(self, serialized, messages, **kwargs):
            self.events.append(("start", len(messages[0])))

        async def on_llm_end(self, response, **kwargs):
            self.events.append(("end", turn_of(response.generations[0][0].message) is not None))

    handler = Seen()
    out = await graph.ainvoke({"messages": [UserMessage(content="hi")]}, {"callbacks": [handler]},
                              context=_ctx(ScriptedClient(_script()), tools=(), system_prompt=None))
    assert handler.events == [("start", 1), ("end", True)] and out["messages"][-1].content == "done"


async def test_unconfigured_checkpointer_revives_our_types_without_warning():
    events = []
    unregister = register_serde_event_listener(events.append)
    try:
        kept = with_checkpointer(graph, InMemorySaver())  # a saver not configured by us
        thread = {"configurable": {"thread_id": "t"}}
        await kept.ainvoke({"messages": [UserMessage(content="1+1")]}, thread,
                           context=_ctx(ScriptedClient(_script({"a": 1, "b": 1}))))
        state = await kept.aget_state(thread)
    finally:
        unregister()
    assert isinstance(state.values["messages"][1], AIMessage)
    assert isinstance(state.values["turns"][0], Turn) and state.values["tool_records"][0].name == "add"
    assert not [e for e in events if e.get("kind") == "msgpack_unregistered_allowed"], events


async def test_approval_in_langchain_hitl_shape_approve_edit_reject():
    calls = [ToolCall.make("add", {"a": 1, "b": 1}), ToolCall.make("add", {"a": 2, "b": 2}),
             ToolCall.make("multiply", {"a": 3, "b": 3})]
    client = ScriptedClient([AssistantMessage(tool_calls=calls), AssistantMessage(content="ok")])
    kept, ctx = with_checkpointer(graph, InMemorySaver()), _ctx(client, approve=True)
    thread = {"configurable": {"thread_id": "hitl"}}
    first = await kept.ainvoke({"messages": [HumanMessage(content="go")]}, thread, context=ctx)
    request = first["__interrupt__"][0].value
    assert [a["name"] for a in request["action_requests"]] == ["add", "add", "multiply"]
    assert request["action_requests"][1]["args"] == {"a": 2, "b": 2}
    assert {c["action_name"] for c in request["review_configs"]} == {"add", "multiply"}
    assert request["review_configs"][0]["allowed_decisions"] == ["approve", "edit", "reject"]
    done = await kept.ainvoke(Command(resume={"decisions": [
        {"type": "approve"},
        {"type": "edit", "edited_action": {"name": "add", "args": {"a": 20, "b": 2}}},
        {"type": "reject", "message": "not that one"}]}), thread, context=ctx)
    records = done["tool_records"]
    assert records[0].content == "2.0"
    assert records[1].arguments == json.dumps({"a": 20, "b": 2}) and records[1].content.endswith("22.0")
    assert records[2].error_kind == "rejected" and "not that one" in records[2].content
    assert done["messages"][-1].content == "ok"
    _valid_openai_conversation(done["messages"])
    with pytest.raises(ValueError, match="one decision per pending tool call"):
        from closedloop.runtime.approval import parse_decisions

        parse_decisions({"decisions": [{"type": "approve"}]}, calls)


async def test_max_turns_is_per_invocation_and_a_thread_goes_on():
    """A model that always calls a tool, max_turns=2, four invocations: 8 model calls in one thread,
    every tool call answered, every request the model saw valid."""
    client = ScriptedClient([AssistantMessage(tool_calls=[ToolCall.make("add", {"a": 1, "b": 1})])], cycle=True)
    kept, ctx = with_checkpointer(graph, InMemorySaver()), _ctx(client, max_turns=2)
    thread = {"configurable": {"thread_id": "long"}}
    for i in range(4):
        out = await kept.ainvoke({"messages": [{"role": "user", "content": f"again {i}"}]}, thread, context=ctx)
        assert len(client.calls) == 2 * (i + 1)  # two model calls per invocation, not a thread total
    assert len(out["turns"]) == 8
    _valid_openai_conversation(out["messages"])
    for request in client.calls:
        _valid_openai_conversation([m for m in request if m.role != "system"])


def test_strict_msgpack_mode_revives_our_types():
    """Under LANGGRAPH_STRICT_MSGPACK (the future default) unregistered types are blocked: ours are not."""
    import subprocess
    import sys

    code = """
import asyncio
from langgraph.checkpoint.memory import InMemorySaver
from closedloop.graphs.react import graph
from closedloop.messages import AssistantMessage, ToolCall, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.runtime import AgentContext, with_checkpointer
script = [AssistantMessage(tool_calls=[ToolCall.make("add", {"a": 1, "b": 2})]), AssistantMessage(content="x")]
g = with_checkpointer(graph, InMemorySaver())
c = {"configurable": {"thread_id": "a"}}
asyncio.run(g.ainvoke({"messages": [UserMessage(content="hi")]}, c,
                      context=AgentContext(client=ScriptedClient(script), tools="arithmetic")))
s = asyncio.run(g.aget_state(c)).values
print(*[type(m).__name__ for m in s["messages"]], type(s["turns"][0]).__name__, type(s["tool_records"][0]).__name__)
"""
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LANGGRAPH_STRICT_MSGPACK": "true"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage", "Turn", "ToolRecord"]
