"""LangChain tools in a ToolRegistry (converted, validated, errors returned to the model) and our
tools as LangChain tools."""

from __future__ import annotations

import json

import pytest
from langchain_core.tools import BaseTool, StructuredTool, ToolException
from langchain_core.tools import tool as lc_tool
from pydantic import BaseModel, Field

from closedloop.graphs.react import graph
from closedloop.langchain_tools import from_langchain_tool, model_from_schema, to_langchain_tool
from closedloop.messages import AssistantMessage, ToolCall, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.plugins import tool_registry
from closedloop.runtime import AgentContext
from closedloop.tool import Tool, ToolRegistry


@lc_tool
def word_count(text: str, unique: bool = False) -> int:
    """Count the words in a text.

    Args:
        text: the text
        unique: count distinct words only
    """
    words = text.split()
    return len(set(words)) if unique else len(words)


@lc_tool
async def fail(reason: str) -> str:
    """Always fails."""
    raise ToolException(f"cannot: {reason}")


class PowArgs(BaseModel):
    base: float = Field(description="the base")
    exp: int = Field(ge=0, le=10, description="a small exponent")


power = StructuredTool.from_function(lambda base, exp: base ** exp, name="power", description="base**exp",
                                     args_schema=PowArgs)


class Shout(BaseTool):
    name: str = "shout"
    description: str = "Upper-case a text."

    def _run(self, text: str) -> str:
        return text.upper()


def test_registration_converts_and_keeps_the_schema():
    reg = ToolRegistry()
    for t in (word_count, fail, power, Shout()):
        assert isinstance(reg.register(t), Tool)
    assert reg.get("word_count").parameters["required"] == ["text"]
    assert reg.get("power").parameters["properties"]["exp"]["maximum"] == 10
    assert reg.get("word_count").description.startswith("Count the words")
    with pytest.raises(TypeError, match="cannot register"):
        reg.register(lambda x: x)


async def test_calls_are_validated_and_errors_go_back_to_the_model():
    reg = ToolRegistry().extend([from_langchain_tool(t) for t in (word_count, fail, power, Shout())])
    assert (await reg.call_json("word_count", {"text": "a b a", "unique": True})).content == "2"
    assert (await reg.call_json("word_count", {"text": "a b a"})).content == "3"
    assert (await reg.call_json("power", {"base": 2, "exp": 3})).content == "8.0"
    assert (await reg.call_json("shout", {"text": "hi"})).content == "HI"
    bad = await reg.call_json("power", {"base": 2, "exp": 11})  # outside the schema: never called
    assert bad.error_kind == "invalid_arguments" and "exp" in bad.error
    extra = await reg.call_json("word_count", {"text": "x", "nope": 1})
    assert extra.error_kind == "invalid_arguments"
    failed = await reg.call_json("fail", {"reason": "no"})
    assert failed.error_kind == "exception" and "cannot: no" in failed.content
    malformed = await reg.call(ToolCall.make("word_count", '{"text": '))
    assert malformed.error_kind == "malformed_json"


async def test_langchain_tools_in_the_react_graph():
    script = [AssistantMessage(tool_calls=[ToolCall.make("word_count", {"text": "one two"}),
                                           ToolCall.make("fail", {"reason": "x"})]), AssistantMessage(content="ok")]
    reg = ToolRegistry().extend([word_count, fail])
    out = await graph.ainvoke({"messages": [UserMessage(content="go")]},
                              context=AgentContext(client=ScriptedClient(script), tools=reg))
    assert [r.content for r in out["tool_records"]][0] == "2"
    assert out["tool_records"][1].error_kind == "exception"
    assert out["messages"][-1].content == "ok"


async def test_our_tools_as_langchain_tools():
    add = tool_registry(["arithmetic"]).get("add")
    lc = to_langchain_tool(add)
    assert lc.name == "add" and set(lc.args) == {"a", "b"}
    assert await lc.ainvoke({"a": 2, "b": 3}) == "5.0"
    assert lc.invoke({"a": 2, "b": 3}) == "5.0"
    # a round trip keeps the schema
    back = from_langchain_tool(lc)
    assert back.parameters["properties"].keys() == add.parameters["properties"].keys()
    out = await lc.ainvoke({"type": "tool_call", "id": "c1", "name": "add", "args": {"a": 1, "b": 1}})
    assert out.tool_call_id == "c1" and out.content == "2.0"


def test_json_schema_to_model():
    model = model_from_schema({"type": "object", "required": ["q"], "properties": {
        "q": {"type": "string"}, "k": {"type": "integer", "default": 3},
        "mode": {"enum": ["a", "b"]}, "tags": {"type": "array", "items": {"type": "string"}}}}, "search")
    assert model(q="x").k == 3
    with pytest.raises(Exception):
        model(q="x", mode="c")
    with pytest.raises(Exception):
        model(k=1)
    assert json.loads(model(q="x", tags=["a"]).model_dump_json())["tags"] == ["a"]
