"""MCP tools in our graphs: a real MCP server process (official SDK) over stdio and streamable HTTP,
its tools driven by the react graph; validation on our side, server errors back to the model."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from closedloop.graphs.react import graph
from closedloop.mcp_client import mcp_tools
from closedloop.messages import AssistantMessage, ToolCall, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.runtime import AgentContext
from closedloop.server.local import stop_process

SERVER = str(Path(__file__).with_name("mcp_demo_server.py"))


def _script():
    return [AssistantMessage(tool_calls=[
        ToolCall.make("divide", {"a": 6, "b": 3}),
        ToolCall.make("divide", {"a": 1, "b": 0}),          # the server's own error
        ToolCall.make("divide", {"a": "six", "b": 1}),      # rejected by our validation
        ToolCall.make("unit_convert", {"value": 10, "unit": "km"}),
        ToolCall.make("unit_convert", {"value": 10, "unit": "parsec"})]),
        AssistantMessage(content="done")]


async def _drive(tools) -> dict:
    assert set(t.name for t in tools) == {"divide", "unit_convert"}
    assert tools.get("unit_convert").parameters["required"] == ["value", "unit"]
    client = ScriptedClient(_script())
    out = await graph.ainvoke({"messages": [UserMessage(content="go")]}, context=AgentContext(client=client, tools=tools))
    return {r.arguments: r for r in out["tool_records"]}, client


def _check(records) -> None:
    recs = list(records.values())
    assert recs[0].content == "2.0" and recs[0].error is None
    assert recs[1].error_kind == "exception" and "division by zero" in recs[1].content
    assert recs[2].error_kind == "invalid_arguments" and "a:" in recs[2].error
    assert recs[3].content == "6.21 mi"
    assert recs[4].error_kind == "invalid_arguments" and "unit" in recs[4].error


async def test_stdio_server_tools_in_react():
    # timeout_s=None: these tests check results; a loaded machine must not turn a call into a timeout
    async with mcp_tools(command=[sys.executable, SERVER, "stdio"], timeout_s=None) as tools:
        records, client = await _drive(tools)
    _check(records)
    # every result, errors included, went back to the model
    assert [m.role for m in client.calls[1][-5:]] == ["tool"] * 5


@pytest.fixture
def http_server(tmp_path, wait_listening):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stdout=log, stderr=subprocess.STDOUT)
    wait_listening(proc, port, tmp_path / "server.log")
    yield f"http://127.0.0.1:{port}/mcp"
    stop_process(proc)
    log.close()


async def test_streamable_http_server_tools_in_react(http_server):
    async with mcp_tools(url=http_server, prefix="", include=["divide", "unit.convert"], timeout_s=None) as tools:
        records, _ = await _drive(tools)
    _check(records)


async def test_exactly_one_transport():
    with pytest.raises(ValueError, match="exactly one"):
        async with mcp_tools():
            pass
