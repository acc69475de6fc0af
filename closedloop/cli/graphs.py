"""``closedloop graphs``: list the registered agent graphs."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from closedloop import plugins


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graphs", help="list the registered agent graphs")
    p.set_defaults(func=handle)
    t = sub.add_parser("tools", help="list the registered tools")
    t.add_argument("modules", nargs="*", help="tool modules to list (default: all)")
    t.add_argument("--json", action="store_true", help="print the tools' schemas (OpenAI tools entries) as JSON")
    t.set_defaults(func=handle_tools)


def handle(args: argparse.Namespace) -> int:
    table = Table(title="agent graphs")
    table.add_column("name")
    table.add_column("graph")
    table.add_column("description")
    for name, ep in sorted(plugins.available("closedloop.graphs").items()):
        plugins.load("closedloop.graphs", name)  # imports its module
        doc = (sys.modules[ep.module].__doc__ or "").strip().splitlines()  # the graph module's docstring
        table.add_row(name, ep.value, doc[0] if doc else "")
    Console().print(table)
    return 0


def handle_tools(args: argparse.Namespace) -> int:
    try:
        registry = plugins.tool_registry(args.modules or None)
    except plugins.PluginNotFound as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}")
        return 2
    if args.json:
        print(json.dumps(registry.schemas, indent=2))
        return 0
    table = Table(title="tools")
    table.add_column("name")
    table.add_column("writes")
    table.add_column("description")
    for t in registry:
        table.add_row(t.name, "yes" if t.mutates else "", t.description.splitlines()[0])
    Console().print(table)
    return 0
