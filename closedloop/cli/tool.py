"""``closedloop tool call NAME --args JSON`` and ``closedloop tool schema NAME``: one tool, by hand.

A call goes through exactly the path a graph's tool node takes (:meth:`ToolRegistry.call`, hence
:meth:`Tool.run`: JSON parsing, pydantic validation, timeout, serialisation), so what works here
works for a model, and is recorded the same way: a run of kind ``"tool"`` holding the one tool call.

Exit codes: 0 success; 2 for the caller's mistakes (unknown tool, malformed JSON, invalid
arguments, unreadable ``@file``); 1 when the tool itself failed (exception, timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax

from closedloop import plugins
from closedloop.messages import ToolCall
from closedloop.tool import ToolRegistry, ToolResult

console = Console()
err = Console(stderr=True)

CALLER_ERRORS = {"unknown_tool", "malformed_json", "invalid_arguments", "bad_input"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tool", help="call one tool, or print its schema")
    tsub = p.add_subparsers(dest="tool_command", required=True)
    c = tsub.add_parser("call", help="validate and run one tool as a graph would, and record the call")
    c.add_argument("name", help="tool name (see `closedloop tools`)")
    c.add_argument("--args", default="{}", dest="arguments",
                   help="arguments as a JSON object, or @FILE to read them from a JSON file (default: {})")
    c.add_argument("--tools", default="", help="comma-separated tool modules to look in (default: all)")
    c.add_argument("--json", action="store_true", help="print the result as one JSON object")
    c.add_argument("--store", help="run store file (default: $CLOSEDLOOP_STORE or ~/.closedloop/runs.duckdb)")
    c.add_argument("--no-store", action="store_true", help="do not record the call")
    c.set_defaults(func=handle_call)
    s = tsub.add_parser("schema", help="print a tool's JSON schema (the OpenAI tools entry)")
    s.add_argument("name")
    s.add_argument("--tools", default="", help="comma-separated tool modules to look in (default: all)")
    s.set_defaults(func=handle_schema)


def _registry(modules: str) -> ToolRegistry:
    return plugins.tool_registry([m for m in modules.split(",") if m] or None)


def read_arguments(spec: str) -> str:
    """The raw JSON text of ``--args``: inline, or the contents of ``@FILE``. Parsing is left to
    :meth:`Tool.validate`, so malformed JSON is reported exactly as a model would see it."""
    if spec.startswith("@"):
        path = Path(spec[1:]).expanduser()
        try:
            return path.read_text()
        except OSError as e:
            raise ValueError(f"cannot read arguments file {path}: {e.strerror or e}") from None
    return spec


def handle_schema(args: argparse.Namespace) -> int:
    try:
        registry = _registry(args.tools)
        schema = registry.get(args.name).schema
    except (plugins.PluginNotFound, KeyError) as e:
        err.print(f"[red]error:[/red] {e.args[0] if e.args else e}")
        return 2
    print(json.dumps(schema, indent=2))
    return 0


def handle_call(args: argparse.Namespace) -> int:
    try:
        registry = _registry(args.tools)
    except plugins.PluginNotFound as e:
        err.print(f"[red]error:[/red] {e}")
        return 2
    store, run_id = _open_run(args)
    call = ToolCall.make(args.name, "{}")
    status, error = "failed", None
    try:
        try:
            raw = read_arguments(args.arguments)
        except ValueError as e:
            result = ToolResult(args.name, f"Error: {e}", str(e), "bad_input")
        else:
            call = ToolCall.make(args.name, raw)
            result = asyncio.run(registry.call(call))
        if store:
            store.log_tool_call(run_id, call, result)
        status = "completed" if result.ok else "failed"
        error = result.error
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        if store:
            outcome = {"tool": args.name, "ok": status == "completed"}
            store.finish_run(run_id, status=status, outcome=outcome, error=error)
    _print(args, result, run_id, store)
    if result.ok:
        return 0
    return 2 if result.error_kind in CALLER_ERRORS else 1


def _open_run(args: argparse.Namespace) -> tuple[Any, str | None]:
    if args.no_store:
        return None, None
    from closedloop.store import RunStore

    store = RunStore(args.store) if args.store else RunStore()
    run_id = store.start_run(kind="tool", config={"tool": args.name, "tools": args.tools},
                             metadata={"tool": args.name})
    return store, run_id


def _print(args: argparse.Namespace, result: ToolResult, run_id: str | None, store: Any) -> None:
    try:
        parsed: Any = json.loads(result.content) if result.ok else None
    except ValueError:
        parsed = result.content
    if args.json:
        print(json.dumps({"tool": result.name, "ok": result.ok, "result": parsed if result.ok else None,
                          "content": result.content, "error": result.error, "error_kind": result.error_kind,
                          "latency_s": result.latency_s, "run_id": run_id}))
        return
    if result.ok:
        body: Any = Syntax(json.dumps(parsed, indent=2), "json") if not isinstance(parsed, str) else parsed
        console.print(Panel(body, title=f"{result.name} ({result.latency_s * 1000:.1f} ms)", border_style="green"))
    else:
        err.print(f"[red]error ({result.error_kind}):[/red] {result.error}")
    if store:
        err.print(f"[dim]call recorded as run {run_id} in {store.path}[/dim]")
