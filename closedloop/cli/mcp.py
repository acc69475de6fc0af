"""``closedloop mcp serve --tools MODULES``: serve tool modules over MCP (stdio or streamable HTTP).

stdio is what desktop clients spawn (``{"command": "closedloop", "args": ["mcp", "serve"]}``); the
protocol owns stdout there, so everything this command says goes to stderr.

A model argument may name local checkpoints inside ``--workdir``; endpoints and hub models only
what ``--allow-model`` / ``$CLOSEDLOOP_TOOL_MODELS`` list (:mod:`closedloop.tool_models`), so a
client can never make a tool send this process's keys to a URL of its choosing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from rich.markup import escape

from closedloop.terminal import make_console
from closedloop import plugins
from closedloop.tool_models import allow_model, allowed_models

err = make_console(stderr=True)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mcp", help="serve tools over the Model Context Protocol")
    msub = p.add_subparsers(dest="mcp_command", required=True)
    s = msub.add_parser("serve", help="serve tool modules over MCP (stdio by default)")
    s.add_argument("--tools", default="", help="comma-separated tool modules (`closedloop tools`); default: all")
    s.add_argument("--transport", choices=["stdio", "http"], default="stdio",
                   help="stdio for a client that starts this process; http serves streamable HTTP at /mcp")
    s.add_argument("--host", default="127.0.0.1", help="HTTP: interface to bind")
    s.add_argument("--port", type=int, default=8000, help="HTTP: port")
    s.add_argument("--path", default="/mcp", help="HTTP: endpoint path")
    s.add_argument("--json-response", action="store_true",
                   help="HTTP: answer each request with a JSON body instead of an SSE stream")
    s.add_argument("--workdir", default=".",
                   help="directory path arguments are resolved against and may not leave (default: current)")
    s.add_argument("--allow-model", action="append", default=[], metavar="SPEC",
                   help="a model a tool argument may name besides local checkpoints in the working directory: "
                        "openai:<model glob>[@<exact base URL>] or hf:<hub id glob> (repeatable; adds to "
                        "$CLOSEDLOOP_TOOL_MODELS); keys come from this process's environment")
    s.set_defaults(func=handle_serve)


def handle_serve(args: argparse.Namespace) -> int:
    from closedloop.mcp_server import build_server, run_http, run_stdio

    workdir = Path(args.workdir).expanduser().resolve()
    if not workdir.is_dir():
        err.print(f"[red]error:[/red] --workdir {escape(str(workdir))} is not a directory")
        return 2
    modules = [m for m in args.tools.split(",") if m] or None
    try:
        for entry in args.allow_model:
            allow_model(entry)
        allowed_models()  # a malformed $CLOSEDLOOP_TOOL_MODELS is said here, not to a client
        registry = plugins.tool_registry(modules)
    except (plugins.PluginNotFound, ValueError) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    _artifacts_inside(workdir)
    os.chdir(workdir)  # tools that write relative files write them in the working directory
    server = build_server(registry, workdir=workdir)
    where = "stdio" if args.transport == "stdio" else f"http://{args.host}:{args.port}{args.path}"
    err.print(f"[dim]closedloop MCP server: {len(registry)} tools on {escape(where)}, workdir {escape(str(workdir))}[/dim]")
    if args.transport == "stdio":
        asyncio.run(run_stdio(server))
    else:
        run_http(server, host=args.host, port=args.port, path=args.path, json_response=args.json_response)
    return 0


def _artifacts_inside(workdir: Path) -> None:
    """Point tool outputs (``CLOSEDLOOP_ARTIFACTS``) into the working directory unless they already
    are, so the paths tools return can be passed back in."""
    current = os.environ.get("CLOSEDLOOP_ARTIFACTS")
    if current and Path(current).expanduser().resolve().is_relative_to(workdir):
        return
    os.environ["CLOSEDLOOP_ARTIFACTS"] = str(workdir / ".closedloop" / "artifacts")
    if current:
        print(f"CLOSEDLOOP_ARTIFACTS={current} is outside the working directory; using "
              f"{os.environ['CLOSEDLOOP_ARTIFACTS']}", file=sys.stderr)
