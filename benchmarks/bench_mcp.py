"""Tool calls per second over MCP (stdio, streamable HTTP) against the same call in-process.

The call is arithmetic ``add`` (microseconds of work), so the figures are the cost of the path:
in-process is ``Tool.run`` (validation, thread hop, serialisation) as a graph's tool node pays it;
"in-memory" adds the SDK's protocol layers (its in-process ``Client(server)``, no transport); stdio
and HTTP add JSON-RPC over a pipe or HTTP to a real ``closedloop mcp serve`` subprocess. Calls
are sequential (one in flight), i.e. the latency a model's tool loop sees.

    python benchmarks/bench_mcp.py [--calls 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Awaitable, Callable

from closedloop import plugins

ARGS = {"a": 2.0, "b": 3.0}


async def _rate(call: Callable[[], Awaitable[Any]], calls: int, repeats: int) -> float:
    """Best of ``repeats`` runs of ``calls`` sequential calls, in calls per second (after a warm-up)."""
    for _ in range(10):
        await call()
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            await call()
        best = max(best, calls / (time.perf_counter() - start))
    return best


async def in_process(calls: int, repeats: int) -> float:
    add = plugins.tool_registry(["arithmetic"]).get("add")

    async def call() -> None:
        r = await add.run(ARGS)
        assert r.ok and r.content == "5.0", r

    return await _rate(call, calls, repeats)


async def _session_rate(session: Any, calls: int, repeats: int) -> float:
    await session.initialize()

    async def call() -> None:
        r = await session.call_tool("add", ARGS)
        assert not r.is_error and r.content[0].text == "5.0", r

    return await _rate(call, calls, repeats)


async def in_memory(calls: int, repeats: int) -> float:
    """The SDK's in-process client on our server object: protocol cost without a transport."""
    from mcp import Client

    from closedloop.mcp_server import build_server

    server = build_server(plugins.tool_registry(["arithmetic"]), workdir=tempfile.gettempdir())
    async with Client(server) as client:

        async def call() -> None:
            r = await client.call_tool("add", ARGS)
            assert not r.is_error and r.content[0].text == "5.0", r

        return await _rate(call, calls, repeats)


def _serve_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "closedloop", "mcp", "serve", "--tools", "arithmetic", "--workdir",
            tempfile.gettempdir(), *extra]


async def over_stdio(calls: int, repeats: int) -> float:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    cmd = _serve_cmd()
    params = StdioServerParameters(command=cmd[0], args=cmd[1:], env=dict(os.environ))
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            return await _session_rate(session, calls, repeats)


async def over_http(calls: int, repeats: int, json_response: bool = False) -> float:
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = ["--json-response"] if json_response else []
    proc = subprocess.Popen(_serve_cmd("--transport", "http", "--port", str(port), *extra), stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the HTTP server did not start") from None
                await asyncio.sleep(0.2)
        async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read, write):
            async with ClientSession(read, write) as session:
                return await _session_rate(session, calls, repeats)
    finally:
        proc.terminate()
        proc.wait(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="sequential calls per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path (best is kept)")
    args = parser.parse_args()
    base = asyncio.run(in_process(args.calls, args.repeats))
    rows = [("in-process Tool.run", base)]
    rows.append(("MCP in-memory (SDK)", asyncio.run(in_memory(args.calls, args.repeats))))
    rows.append(("MCP stdio", asyncio.run(over_stdio(args.calls, args.repeats))))
    rows.append(("MCP HTTP (SSE)", asyncio.run(over_http(args.calls, args.repeats))))
    rows.append(("MCP HTTP (JSON)", asyncio.run(over_http(args.calls, args.repeats, json_response=True))))
    print(f"{'path':<22} {'calls/s':>10} {'ms/call':>9} {'in-process / this':>18}")
    for name, rate in rows:
        print(f"{name:<22} {rate:>10.0f} {1000 / rate:>9.3f} {base / rate:>18.1f}")


if __name__ == "__main__":
    main()
