"""Serve closedloop tools over the Model Context Protocol (MCP) with the official ``mcp`` SDK.

Any MCP client (Claude Desktop, an IDE, another agent framework) can then call the same typed
``@tool`` functions our graphs call. The tools come from a :class:`~closedloop.tool.ToolRegistry`
(in practice :func:`closedloop.plugins.tool_registry`, i.e. the ``closedloop.tools`` entry points),
so this module never imports a tool module itself.

What a client sees is what a graph sees:

- ``tools/list`` advertises each tool's JSON schema exactly as :attr:`Tool.parameters` generates
  it (the same dict the OpenAI protocol and chat templates get);
- ``tools/call`` goes through :meth:`Tool.run` (pydantic validation, timeout, serialisation), and
  every failure a graph would show the model (malformed or invalid arguments, unknown tool, the
  tool's exception or timeout) comes back as an MCP tool error (``isError: true`` with the same
  message), never as a protocol error, so the calling model can read it and retry.

Files. Array arguments travel as paths (``.npy``/``.npz``/``.safetensors``) or inline lists
(:mod:`closedloop.artifacts`). A server reachable by a remote model must not read arbitrary files,
so it has a working directory: a string argument that looks like a path (it contains a path
separator, starts with ``~`` or ``.``, or ends in a file suffix such as ``.npy``) is resolved
against the working directory (symlinks followed) and must stay inside it; otherwise the call is a
tool error and the tool never runs; the refusal shows the argument as given, never the working
directory's absolute path or where a link points. The path of an ``hf:``/``vllm:`` model spec is
confined the same way, and model arguments pass the operator's allow-list
(:mod:`closedloop.tool_models`), so a client cannot make a tool send this server's keys to a URL of
its choosing. Relative paths are handed to the tool resolved, so the server process's own current
directory does not matter. Tool outputs saved as artifacts should land in the
working directory too (the CLI points ``CLOSEDLOOP_ARTIFACTS`` there), so a client can pass a
returned path back in.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import mcp_types as types
from mcp.server import Server

from closedloop.tool import ArgumentLimits, ToolRegistry

__all__ = ["PathOutsideWorkdir", "build_server", "check_paths", "mcp_tools", "run_stdio", "http_app", "run_http",
           "unreadable_line_error"]

# Suffixes that make a bare file name count as a path (artifacts and the data files tools read).
PATH_SUFFIXES = (".npy", ".npz", ".safetensors", ".json", ".jsonl", ".csv", ".txt", ".parquet", ".pt", ".bin")
_SEP = re.compile(r"[/\\]")


class PathOutsideWorkdir(ValueError):
    """A path argument resolves outside the server's working directory."""


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _looks_like_path(value: str) -> bool:
    if _URL.match(value) and not value.lower().startswith("file://"):
        return False  # a URL is not a local file
    return bool(_SEP.search(value)) or value.startswith(("~", ".")) or value.lower().endswith(PATH_SUFFIXES)


def check_paths(arguments: Any, workdir: Path) -> Any:
    """Return ``arguments`` with every path-like string resolved inside ``workdir``.

    Walks nested lists and dicts (inline arrays are lists of numbers and pass untouched); the path
    of an ``hf:``/``vllm:`` model spec counts as a path. Raises :class:`PathOutsideWorkdir` naming
    the argument when a path escapes the working directory; the message shows the argument as
    given, never where it resolved to nor the directory itself (a client must not learn the
    server's layout or a link's target). Relative paths become absolute when they name an
    existing file or end in a data-file suffix. A string no filesystem could open (a NUL byte, a
    name over the system's limit) reaches the tool unchanged, whose own check refuses it.
    """
    root = workdir.resolve()
    max_depth = ArgumentLimits().max_depth

    def walk(value: Any, where: str, depth: int) -> Any:
        if depth > max_depth:
            return value  # Tool.run refuses arguments nested this deep
        if isinstance(value, str):
            for prefix in _MODEL_PREFIXES:
                if value.startswith(prefix):
                    return prefix + _inside(value[len(prefix):], root, where)
            return _inside(value, root, where) if _looks_like_path(value) else value
        if isinstance(value, list):
            return [walk(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, dict):
            return {k: walk(v, f"{where}.{k}", depth + 1) for k, v in value.items()}
        return value

    if not isinstance(arguments, dict):
        return arguments  # Tool.run reports the wrong type to the caller
    return {k: walk(v, k, 1) for k, v in arguments.items()}


_MODEL_PREFIXES = ("hf:", "vllm:")  # model specs whose rest is a local path (or a hub id)


def _inside(value: str, root: Path, where: str) -> str:
    """``value`` resolved against ``root``; :class:`PathOutsideWorkdir` when it leaves it."""
    try:
        resolved = (root / Path(value).expanduser()).resolve()
        inside = resolved.is_relative_to(root)
        exists = inside and resolved.exists()
    except (OSError, ValueError, RuntimeError):
        return value  # not a path any filesystem call accepts: the tool's own check says so
    if not inside:
        shown = value if len(value) <= 200 else value[:200] + "..."
        raise PathOutsideWorkdir(f"{where}: path {shown!r} is outside the server's working directory; use a "
                                 f"path inside it (relative paths resolve against it)")
    # Hand the tool an absolute path only when the string surely names a file; other text that
    # merely contains a slash ("1/2") reaches the tool unchanged.
    return str(resolved) if exists or value.lower().endswith(PATH_SUFFIXES) else value


def mcp_tools(registry: ToolRegistry) -> list[types.Tool]:
    """The MCP ``Tool`` entries: name, description and our own JSON schema, unchanged."""
    out = []
    for t in registry:
        annotations = types.ToolAnnotations(read_only_hint=not t.mutates, destructive_hint=t.mutates)
        out.append(types.Tool(name=t.name, description=t.description, input_schema=t.parameters,
                              annotations=annotations))
    return out


def _error(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=f"Error: {message}")], is_error=True)


def build_server(registry: ToolRegistry, *, workdir: str | os.PathLike[str] | None = None,
                 name: str = "closedloop") -> Server:
    """A low-level MCP :class:`~mcp.server.Server` exposing ``registry``'s tools.

    The low-level API (not ``MCPServer``/FastMCP) because the schemas must be ours, not ones the SDK
    re-derives from function signatures.
    """
    import closedloop

    root = Path(workdir if workdir is not None else os.getcwd()).resolve()
    if not root.is_dir():
        raise NotADirectoryError(f"working directory {root} does not exist or is not a directory")
    from closedloop.paths import allow_root

    allow_root(root)  # the tools' own working-root check (closedloop.paths) admits the server's directory
    listed = mcp_tools(registry)

    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name not in registry:
            shown = params.name if len(params.name) <= 100 else params.name[:100] + "..."
            return _error(f"unknown tool {shown!r}; available tools: {sorted(registry.tools)}")
        try:
            arguments = check_paths(params.arguments or {}, root)
        except PathOutsideWorkdir as e:
            return _error(str(e))
        except Exception as e:  # noqa: BLE001 - a tool call's trouble is a tool error, never a protocol error
            return _error(f"arguments of {params.name} could not be checked ({type(e).__name__})")
        result = await registry.get(params.name).run(arguments)
        if not result.ok:
            return _error(result.error or "tool failed")
        structured = None
        try:
            parsed = json.loads(result.content)
            structured = parsed if isinstance(parsed, dict) else None
        except ValueError:
            pass
        return types.CallToolResult(content=[types.TextContent(type="text", text=result.content)],
                                    structured_content=structured)

    def input_schema(tool_name: str) -> dict[str, Any] | None:
        return registry.get(tool_name).parameters if tool_name in registry else None

    return Server(name, version=closedloop.__version__,
                  instructions="closedloop tools; path arguments must lie inside the server's working directory "
                               "(relative paths resolve against it)",
                  get_tool_input_schema=input_schema, on_list_tools=on_list_tools, on_call_tool=on_call_tool)


async def run_stdio(server: Server) -> None:
    """Serve one client over stdin/stdout until it disconnects.

    A line that is not a JSON-RPC message is answered with an error: the SDK's stdio transport
    only logs it, so a client that sent a malformed request would wait for its reply forever.
    """
    import anyio
    from mcp.server.stdio import stdio_server
    from mcp.shared.message import SessionMessage

    async with stdio_server() as (read_stream, write_stream):
        inbox_in, inbox = anyio.create_memory_object_stream[SessionMessage | Exception](0)

        async def forward() -> None:
            async with inbox_in:
                async for item in read_stream:
                    if isinstance(item, Exception):
                        await write_stream.send(SessionMessage(unreadable_line_error(item)))
                    else:
                        await inbox_in.send(item)

        async with anyio.create_task_group() as tg:
            tg.start_soon(forward)
            await server.run(inbox, write_stream, server.create_initialization_options())
            tg.cancel_scope.cancel()


def unreadable_line_error(exc: Exception) -> types.JSONRPCError:
    """The JSON-RPC answer to a line the transport could not read as a message (``exc`` is what
    the SDK's validation raised): -32700 for text that is not JSON, -32600 for JSON that is not a
    valid message. Either carries the line's own id when one can be read (from the JSON, or from
    the complete prefix of a truncated line), so the client's pending request fails instead of
    waiting forever; else id null."""
    import pydantic_core
    from pydantic import ValidationError

    errors = exc.errors() if isinstance(exc, ValidationError) else []
    unparsable = not errors or any(e["type"] == "json_invalid" for e in errors)
    candidates: list[Any] = [e.get("input") for e in errors]
    if unparsable:
        for text in [c for c in candidates if isinstance(c, str)]:
            try:
                candidates.append(pydantic_core.from_json(text, allow_partial=True))
            except ValueError:
                pass
    request_id = next((c["id"] for c in candidates if isinstance(c, dict) and _is_request_id(c.get("id"))), None)
    if unparsable:
        error = types.ErrorData(code=types.PARSE_ERROR, message="Parse error: not JSON")
    else:
        error = types.ErrorData(code=types.INVALID_REQUEST,
                                message="Invalid Request: not a JSON-RPC 2.0 request, notification or response")
    return types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)


def _is_request_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def http_app(server: Server, *, path: str = "/mcp", host: str = "127.0.0.1", json_response: bool = False) -> Any:
    """The streamable-HTTP ASGI app (Starlette) serving ``server`` at ``path``.

    ``json_response`` answers each POST with a plain JSON body instead of an SSE stream (both are
    streamable HTTP; SSE lets a server push progress, JSON is cheaper per call).
    """
    return server.streamable_http_app(streamable_http_path=path, host=host, json_response=json_response)


def run_http(server: Server, *, host: str = "127.0.0.1", port: int = 8000, path: str = "/mcp",
             json_response: bool = False, log_level: str = "warning") -> None:
    """Serve over streamable HTTP with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(http_app(server, path=path, host=host, json_response=json_response), host=host, port=port,
                log_level=log_level)
