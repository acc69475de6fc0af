"""``closedloop tools [MODULE ...]``: list the registered tools, by tool module.

Built-in tool modules are described from :mod:`closedloop.tools.catalog` without being imported
(they import torch, scipy, sacrebleu...); another package's tool module is imported to be
described. ``--json`` prints the tools' schemas, which needs the real tools.
"""

from __future__ import annotations

import argparse
import json
import sys

from closedloop import plugins


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("tools", description=__doc__.splitlines()[0])
    t.add_argument("modules", nargs="*", help="tool modules to list (default: all)")
    t.add_argument("--json", action="store_true", help="print the tools' schemas (OpenAI tools entries) as JSON")
    t.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    try:
        if args.json:
            print(json.dumps(plugins.tool_registry(args.modules or None).schemas, indent=2))
            return 0
        rows = tool_rows(args.modules or None)
    except (plugins.PluginNotFound, plugins.DuplicatePluginError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from closedloop.terminal import make_console
    from rich.table import Table

    table = Table(title="tools")
    for column in ("name", "module", "writes"):  # identifiers are never cut: users paste them into --tools
        table.add_column(column, no_wrap=True, overflow="ignore")
    table.add_column("description")
    for module, name, mutates, description in rows:
        table.add_row(name, module, "yes" if mutates else "", description)
    make_console().print(table)
    return 0


def tool_rows(modules: list[str] | None = None) -> list[tuple[str, str, bool, str]]:
    """(module, tool name, writes, first line of its description) for each tool of the named tool
    modules (all when None); the catalog answers for built-in ones, so they are not imported."""
    from closedloop.tools.catalog import CATALOG, ToolSummary

    registry = plugins.registry("tools")
    rows = []
    for module in modules if modules is not None else registry.names():
        plugin = registry.get(module)
        summaries = CATALOG.get(plugin.target)
        if summaries is None:  # not a built-in: import it
            summaries = tuple(ToolSummary(t.name, t.mutates, t.description.splitlines()[0])
                              for t in registry.load(module))
        rows += [(module, name, mutates, description) for name, mutates, description in summaries]
    return rows
