"""The messages channel's shortcuts give exactly what the general paths give.

``add_any_messages`` appends new messages itself instead of calling LangGraph's ``add_messages``,
and a LangChain message made from one of ours remembers that message instead of being converted
back. Both are pinned here against the general path on the same input: ``add_messages`` on
copies, and a fresh conversion of a copy (a copy is a new object, so nothing is remembered for it).
"""

from __future__ import annotations

import copy
import uuid

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, RemoveMessage
from langchain_core.messages import ToolMessage as LCToolMessage
from langgraph.graph.message import add_messages

from closedloop.graphs.react import graph
from closedloop.messages import AssistantMessage, FunctionCall, SystemMessage, ToolCall, ToolMessage, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.plugins import tool_registry
from closedloop.runtime import AgentContext
from closedloop.runtime.convert import add_any_messages, ai_message, to_closedloop, to_langchain


def _thread() -> list:
    return [HumanMessage(content="q", id="h"), AIMessage(content="", tool_calls=[
        {"name": "add", "args": {"a": 1}, "id": "c1"}], id="a"), LCToolMessage(content="1", tool_call_id="c1", id="t")]


def _shape(messages: list, fresh_ids: set[str]) -> list:
    """Messages as comparable data; ids the reducer made up (uuid4, different on each side) as a mark."""
    return [(type(m).__name__, m.content, "<new>" if m.id in fresh_ids else m.id) for m in messages]


CASES = {
    "append one": lambda: [AIMessage(content="x")],
    "append several": lambda: [AIMessage(content="x"), LCToolMessage(content="2", tool_call_id="c2")],
    "append with a fresh id": lambda: [HumanMessage(content="again", id="new-id")],
    "replace by id": lambda: [LCToolMessage(content="changed", tool_call_id="c1", id="t")],
    "remove by id": lambda: [RemoveMessage(id="a")],
    "a chunk": lambda: [AIMessageChunk(content="partial")],
    "one id twice": lambda: [HumanMessage(content="1", id="dup"), HumanMessage(content="2", id="dup")],
    "nothing": lambda: [],
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_reducer_gives_what_add_messages_gives(case):
    left, right = _thread(), CASES[case]()
    expected_left, expected_right = copy.deepcopy(left), copy.deepcopy(right)
    expected = add_messages(expected_left, expected_right)
    got = add_any_messages(left, right)
    new = {m.id for m in got} - {m.id for m in _thread()} - {m.id for m in CASES[case]() if m.id}
    new_expected = {m.id for m in expected} - {m.id for m in _thread()} - {m.id for m in CASES[case]() if m.id}
    assert _shape(got, new) == _shape(expected, new_expected)
    assert all(m.id for m in got) and len({m.id for m in got}) == len(got)
    assert [m.content for m in left] == [m.content for m in _thread()]  # the stored list is not changed


def test_one_message_object_added_twice_is_kept_once_as_add_messages_does():
    m = AIMessage(content="same")
    got = add_any_messages(_thread(), [m, m])
    assert [x.content for x in got] == ["q", "", "1", "same"]


def test_the_reducer_gives_a_new_message_its_id_once_for_both_reads_of_a_step():
    """LangGraph runs the reducer twice per step on the same written message (for the routers,
    then for the state); the id given the first time is the one the state keeps."""
    m = AIMessage(content="x")
    first = add_any_messages(_thread(), [m])
    second = add_any_messages(_thread(), [m])
    assert first[-1].id == second[-1].id == m.id and uuid.UUID(m.id).version == 4


def test_a_thread_message_without_an_id_gets_one_as_add_messages_gives_it():
    left = _thread() + [HumanMessage(content="written without the reducer")]
    got = add_any_messages(left, [AIMessage(content="x")])
    assert all(m.id for m in got) and got[3].id == left[3].id


OURS = [
    AssistantMessage(tool_calls=[ToolCall.make("add", {"a": 1, "b": 2})]),
    AssistantMessage(content="", tool_calls=[ToolCall.make("add", {"a": 1})]),
    AssistantMessage(content=None),
    AssistantMessage(content=""),
    AssistantMessage(content="plain"),
    AssistantMessage(content="thinking done", reasoning="because"),
    AssistantMessage(content="x", reasoning=""),
    AssistantMessage(tool_calls=[ToolCall.make("add", '{"a": 1'), ToolCall.make("mul", {"b": 2})]),
    AssistantMessage(tool_calls=[ToolCall(id="same", function=FunctionCall(name="a", arguments="{}")),
                                 ToolCall(id="same", function=FunctionCall(name="b", arguments="{ }"))]),
    AssistantMessage(tool_calls=[]),
    AssistantMessage(tool_calls=[ToolCall.make("add", '{"a":1,  "b" : 2}')]),  # the model's spacing kept
    ToolMessage(tool_call_id="c", content="3"),
    ToolMessage(tool_call_id="c", content="Error: bad", error="bad", name="add"),
    ToolMessage(tool_call_id="c", content="", error="", name=""),
    UserMessage(content="hi", name="ann"),
    UserMessage(content="hi", name=""),
    UserMessage(content=[{"type": "text", "text": "parts"}]),
    SystemMessage(content="sys"),
]


@pytest.mark.parametrize("message", OURS, ids=[f"{m.role}-{i}" for i, m in enumerate(OURS)])
def test_a_remembered_conversion_equals_a_fresh_one(message):
    lc = to_langchain(message)
    assert to_closedloop(lc) == to_closedloop(lc.model_copy(deep=True))


def test_the_assistant_message_carries_the_exact_openai_tool_calls():
    m = AssistantMessage(tool_calls=[ToolCall.make("add", '{"a":1,  "b": 2}'), ToolCall.make("x", '{"bad')])
    assert ai_message(m).additional_kwargs["tool_calls"] == [c.model_dump(mode="json") for c in m.tool_calls]


async def test_the_tool_node_and_the_recorder_read_the_turns_own_message():
    """What the model node wrote is read back as the turn's message itself (no second conversion),
    and it is equal to what a fresh conversion of the channel's message gives."""
    client = ScriptedClient([AssistantMessage(tool_calls=[ToolCall.make("add", {"a": 3, "b": 4})]),
                             AssistantMessage(content="7")])
    out = await graph.ainvoke({"messages": [UserMessage(content="3+4?")]},
                              context=AgentContext(client=client, tools=tool_registry(["arithmetic"])))
    ai = out["messages"][1]
    assert to_closedloop(ai) is out["turns"][0].message
    assert to_closedloop(ai.model_copy(deep=True)) == out["turns"][0].message
