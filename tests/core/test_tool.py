"""@tool: schema from signature and docstring, and every error path returned to the model."""

import asyncio
import json
import time
from typing import Literal

import pytest

from closedloop.messages import ToolCall
from closedloop.tool import Tool, ToolDefinitionError, ToolRegistry, tool


@tool
def lookup(city: str, unit: Literal["c", "f"] = "c", days: int = 1) -> dict:
    """Look up a forecast.

    Args:
        city: City name, e.g. Paris.
        unit: Temperature unit.
        days: How many days ahead
            (continued on a second line).
    """
    return {"city": city, "unit": unit, "days": days}


def test_schema_from_signature_and_docstring():
    fn = lookup.schema["function"]
    assert fn["name"] == "lookup" and fn["description"] == "Look up a forecast."
    props = fn["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": "City name, e.g. Paris."}
    assert props["unit"]["enum"] == ["c", "f"] and props["unit"]["default"] == "c"
    assert props["days"]["description"] == "How many days ahead (continued on a second line)."
    assert fn["parameters"]["required"] == ["city"]
    assert fn["parameters"]["additionalProperties"] is False


async def test_valid_call_returns_json():
    r = await lookup.run('{"city": "Oslo", "days": "3"}')  # "3" is coerced as pydantic does
    assert r.ok and json.loads(r.content) == {"city": "Oslo", "unit": "c", "days": 3}


@pytest.mark.parametrize("args, kind, fragment", [
    ('{"city": ', "malformed_json", "not valid JSON"),
    ("[1, 2]", "invalid_arguments", "must be a JSON object"),
    ('{"unit": "c"}', "invalid_arguments", "city: Field required"),
    ('{"city": "Oslo", "unit": "k"}', "invalid_arguments", "unit"),
    ('{"city": "Oslo", "extra": 1}', "invalid_arguments", "extra: Extra inputs are not permitted"),
    ('{"city": "Oslo", "days": "many"}', "invalid_arguments", "days"),
])
async def test_bad_arguments_come_back_as_errors(args, kind, fragment):
    r = await lookup.run(args)
    assert not r.ok and r.error_kind == kind
    assert fragment in r.content and r.content.startswith("Error:")
    msg = r.to_message("call_1")
    assert msg.tool_call_id == "call_1" and msg.error == r.error


async def test_exceptions_and_timeouts_are_reported_and_the_caller_survives():
    @tool(timeout_s=0.2)
    async def slow(x: int) -> int:
        await asyncio.sleep(5)
        return x

    @tool(timeout_s=0.2)
    def slow_sync(x: int) -> int:
        time.sleep(0.6)
        return x

    @tool
    def broken(x: int) -> int:
        raise ZeroDivisionError("boom")

    t0 = time.perf_counter()
    r = await slow.run({"x": 1})
    assert r.error_kind == "timeout" and "timed out after 0.2 s" in r.content
    assert time.perf_counter() - t0 < 2
    assert (await slow_sync.run({"x": 1})).error_kind == "timeout"
    r = await broken.run({"x": 1})
    assert r.error_kind == "exception" and "ZeroDivisionError: boom" in r.content


def test_definition_errors():
    with pytest.raises(ToolDefinitionError):
        @tool
        def untyped(x):  # noqa: ANN001
            return x
    with pytest.raises(ToolDefinitionError):
        @tool
        def star(*xs: int) -> int:
            return 0
    with pytest.raises(ToolDefinitionError):
        Tool(lambda: 1, name="bad name!")


async def test_registry_dispatch_duplicates_and_unknown_tools():
    reg = ToolRegistry().extend([lookup])
    assert [s["function"]["name"] for s in reg.schemas] == ["lookup"]
    with pytest.raises(ToolDefinitionError):
        reg.register(tool(lookup.fn))  # same name, different object
    r = await reg.call(ToolCall.make("nope", {}))
    assert r.error_kind == "unknown_tool" and "lookup" in r.content
    with pytest.raises(KeyError, match="available"):
        reg.get("nope")
    assert (await reg.call_json("lookup", '{"city": "Rome"}')).ok


async def test_async_tools_and_direct_calls():
    @tool
    async def double(x: float) -> float:
        """Double x."""
        return 2 * x

    assert (await double.run({"x": 2.5})).content == "5.0"
    assert await double(1.0) == 2.0


async def test_thread_isolated_tools_see_the_callers_context_variables():
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    @tool
    def read_var() -> str:
        """Read the context variable."""
        return var.get()

    var.set("from the caller")
    assert (await read_var.run({})).content == "from the caller"
