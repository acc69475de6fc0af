"""``closedloop tool call NAME --args JSON`` and ``closedloop tool schema NAME``: one tool, by hand.

A call goes through exactly the path a graph's tool node takes (:meth:`ToolRegistry.call`, hence
:meth:`Tool.run`: JSON parsing, pydantic validation, timeout, serialisation), so what works here
works for a model, and is recorded the same way: a run of kind ``"tool"`` holding the one tool call.

Exit codes: 0 success; 2 for the caller's mistakes (unknown tool, malformed JSON, invalid
arguments, unreadable or oversized ``@file``, a model the operator did not allow); 1 when the tool
itself failed (exception, timeout) or the call could not be recorded.

``--allow-model SPEC`` (repeatable) adds to ``$CLOSEDLOOP_TOOL_MODELS``: the endpoints and hub
models a model argument may name besides local checkpoints (:mod:`closedloop.tool_models`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.text import Text

from closedloop.terminal import make_console
from closedloop import plugins
from closedloop.messages import ToolCall
from closedloop.tool import ArgumentLimits, ToolRegistry, ToolResult
from closedloop.tool_models import allow_model, allowed_models

console = make_console()
err = make_console(stderr=True)

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
    c.add_argument("--allow-model", action="append", default=[], metavar="SPEC",
                   help="a model a tool argument may name besides local checkpoints in the working root: "
                        "openai:<model glob>[@<exact base URL>] or hf:<hub id glob> (repeatable; adds to "
                        "$CLOSEDLOOP_TOOL_MODELS)")
    c.set_defaults(func=handle_call)
    s = tsub.add_parser("schema", help="print a tool's JSON schema (the OpenAI tools entry)")
    s.add_argument("name", help="tool name (see `closedloop tools`)")
    s.add_argument("--tools", default="", help="comma-separated tool modules to look in (default: all)")
    s.set_defaults(func=handle_schema)


def _registry(modules: str) -> ToolRegistry:
    return plugins.tool_registry([m for m in modules.split(",") if m] or None)


def read_arguments(spec: str, limit: int = ArgumentLimits().max_bytes) -> str:
    """The raw JSON text of ``--args``: inline, or the contents of ``@FILE``, of which at most
    ``limit`` bytes are read (``@/dev/zero`` or a huge file is refused, never loaded). Parsing is
    left to :meth:`Tool.validate`, so malformed JSON is reported exactly as a model would see it."""
    if not spec.startswith("@"):
        return spec
    path = Path(spec[1:]).expanduser()
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ValueError(f"cannot read arguments file {path}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ValueError(f"arguments file {path} holds more than {limit} bytes, the limit for tool arguments; "
                         f"pass large arrays as .npy/.npz file paths")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"arguments file {path} is not UTF-8 text (byte {e.start})") from None


def handle_schema(args: argparse.Namespace) -> int:
    try:
        registry = _registry(args.tools)
        schema = registry.get(args.name).schema
    except (plugins.PluginNotFound, KeyError) as e:
        err.print(f"[red]error:[/red] {escape(str(e.args[0] if e.args else e))}")
        return 2
    print(json.dumps(schema, indent=2))
    return 0


def handle_call(args: argparse.Namespace) -> int:
    try:
        for entry in args.allow_model:
            allow_model(entry)
        allowed_models()  # a malformed $CLOSEDLOOP_TOOL_MODELS is the operator's error, said here
        registry = _registry(args.tools)
    except (plugins.PluginNotFound, ValueError) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    store, run_id = _open_run(args)
    call = ToolCall.make(args.name, "{}")
    status, error, unrecorded = "failed", None, None
    try:
        try:
            raw = read_arguments(args.arguments)
        except ValueError as e:
            result = ToolResult(args.name, f"Error: {e}", str(e), "bad_input")
        else:
            call = ToolCall.make(args.name, raw)
            result = asyncio.run(registry.call(call))
        status = "completed" if result.ok else "failed"
        error = result.error
        if store:
            unrecorded = _record(store, run_id, call, result)
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        if store:
            outcome = {"tool": args.name, "ok": status == "completed"}
            store.finish_run(run_id, status=status, outcome=outcome, error=error)
    _print(args, result, run_id, None if unrecorded else store)
    if unrecorded:
        err.print(f"[red]error:[/red] the call could not be recorded in {escape(str(store.path))}: {escape(unrecorded)}")
    if not result.ok:
        return 2 if result.error_kind in CALLER_ERRORS else 1
    return 1 if unrecorded else 0


def _record(store: Any, run_id: str | None, call: ToolCall, result: ToolResult) -> str | None:
    """Log the call; what went wrong as one line instead of a traceback (the result is printed
    either way, and the run is still finished as failed or completed)."""
    try:
        store.log_tool_call(run_id, call, result)
    except Exception as e:  # noqa: BLE001 - reported to the user, with the exit code
        text = str(e)
        return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"
    return None


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
        body: Any = Syntax(json.dumps(parsed, indent=2), "json") if not isinstance(parsed, str) else Text(parsed)
        console.print(Panel(body, title=f"{result.name} ({result.latency_s * 1000:.1f} ms)", border_style="green",
                            expand=False))
    else:
        err.print(f"[red]error ({result.error_kind}):[/red] {escape(result.error or '')}")
    if store:
        err.print(f"[dim]call recorded as run {run_id} in {escape(str(store.path))}[/dim]")
