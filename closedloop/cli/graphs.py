"""``closedloop graphs``: list the registered agent graphs (no graph is imported)."""

from __future__ import annotations

import argparse
import sys

from closedloop import plugins


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graphs", description=__doc__.splitlines()[0])
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from closedloop.terminal import make_console
    from rich.table import Table

    graphs = plugins.registry("graphs")
    try:
        found = graphs.plugins()
    except plugins.DuplicatePluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = Table(title="agent graphs")
    table.add_column("name")
    table.add_column("entry point")
    table.add_column("description")
    for name, plugin in found.items():
        table.add_row(name, plugin.target, graphs.describe(name))
    make_console().print(table)
    return 0
