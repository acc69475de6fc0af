"""Any MCP server's tools as tools of our graphs (the client side; :mod:`closedloop.mcp_server` serves ours).

    async with mcp_tools(command=["python", "server.py"]) as tools:        # stdio
        out = await graph.ainvoke(inputs, context=AgentContext(client=client, tools=tools))
    async with mcp_tools(url="http://127.0.0.1:8000/mcp") as tools:       # streamable HTTP
        ...

Each MCP tool becomes our :class:`~closedloop.tool.Tool` (:func:`closedloop.langchain_tools.schema_tool`):
its ``inputSchema`` is validated on our side before anything is sent (a malformed call never reaches
the server and the model sees what was wrong), the call has our timeout, and a result with
``isError`` comes back to the model as a tool error, like any failing tool of ours. The session
lives as long as the ``async with`` block; the registry's tools must be called inside it.
"""

from __future__ import annotations

import json
import re
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from closedloop.langchain_tools import schema_tool
from closedloop.tool import ToolRegistry

__all__ = ["MCPToolError", "mcp_tools", "result_text"]


class MCPToolError(RuntimeError):
    """An MCP server reported a tool error (``isError: true``); its text goes back to the model."""


def result_text(result: Any) -> str:
    """The model-facing text of a ``CallToolResult``: text parts joined; other parts described;
    structured content as JSON when there is no text."""
    parts = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind in {"image", "audio"}:
            parts.append(f"[{kind} {getattr(block, 'mime_type', '')}, {len(getattr(block, 'data', '') or '')} base64 chars]")
        elif kind == "resource_link":
            parts.append(f"[resource {getattr(block, 'uri', '')}]")
        elif kind == "resource":
            res = block.resource
            parts.append(getattr(res, "text", None) or f"[resource {getattr(res, 'uri', '')}]")
    if not parts and getattr(result, "structured_content", None) is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


def _our_name(name: str, prefix: str) -> str:
    """OpenAI's tool-name rule ([A-Za-z0-9_-]{1,64}); MCP allows more (dots, slashes)."""
    return re.sub(r"[^A-Za-z0-9_\-]", "_", prefix + name)[:64]


@asynccontextmanager
async def mcp_tools(*, command: Sequence[str] | None = None, url: str | None = None, env: dict[str, str] | None = None,
                    cwd: str | None = None, prefix: str = "", include: Sequence[str] | None = None,
                    timeout_s: float | None = 60.0) -> AsyncIterator[ToolRegistry]:
    """Connect to one MCP server (``command`` for stdio, ``url`` for streamable HTTP) and yield its tools.

    ``prefix`` is prepended to every tool name (to combine servers with clashing names);
    ``include`` keeps only the named tools.
    """
    if (command is None) == (url is None):
        raise ValueError("give exactly one of command= (stdio) or url= (streamable HTTP)")
    from mcp import ClientSession

    async with AsyncExitStack() as stack:
        if command is not None:
            from mcp.client.stdio import StdioServerParameters, stdio_client

            if not command:
                raise ValueError("command= must name the server program")
            params = StdioServerParameters(command=command[0], args=list(command[1:]), env=env, cwd=cwd)
            read, write = await stack.enter_async_context(stdio_client(params))
        else:
            from mcp.client.streamable_http import streamable_http_client

            assert url is not None  # exactly one of command/url was given (checked above)
            read, write = await stack.enter_async_context(streamable_http_client(url))
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        listed, cursor = [], None
        while True:
            from mcp_types import PaginatedRequestParams

            page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
            listed.extend(page.tools)
            cursor = getattr(page, "next_cursor", None)
            if not cursor:
                break
        registry = ToolRegistry()
        for spec in listed:
            if include is not None and spec.name not in include:
                continue
            registry.register(schema_tool(_our_name(spec.name, prefix), spec.description or spec.name,
                                          dict(spec.input_schema or {}), _caller(session, spec.name,
                                                                               spec.input_schema or {}),
                                          timeout_s=timeout_s))
        yield registry


def _caller(session: Any, name: str, schema: dict[str, Any]):
    required = set(schema.get("required", []))

    async def call(**kwargs: Any) -> str:
        # optional arguments the model left out are not sent (our model fills them with None)
        args = {k: v for k, v in kwargs.items() if v is not None or k in required}
        result = await session.call_tool(name, args)
        text = result_text(result)
        if getattr(result, "is_error", False):
            raise MCPToolError(text or "the MCP server reported an error")
        return text

    return call
