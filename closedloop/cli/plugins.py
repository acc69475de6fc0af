"""``closedloop plugins [KIND]``: every plugin of every kind, and where each comes from.

Lists the entry points of each kind's group (and anything registered in-process) with the
distribution that declares it, its ``module:attr`` and its module's one-line description, importing
none of them.
"""

from __future__ import annotations

import argparse
import json
import sys

from closedloop import plugins


def register(sub: argparse._SubParsersAction) -> None:
    kinds = "\n".join(f"  {k.name:<13} {k.group}: {k.contract}" for k in plugins.KINDS.values())
    p = sub.add_parser("plugins", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=f"kinds (entry-point groups) and what an entry point names:\n{kinds}".replace("%", "%%"))
    p.add_argument("kind", nargs="?", choices=list(plugins.KINDS), help="list only this kind")
    p.add_argument("--json", action="store_true", help="print one JSON object per plugin, one per line")
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    kinds = [args.kind] if args.kind else list(plugins.KINDS)
    rows: list[dict[str, str]] = []
    errors: list[str] = []
    empty: list[str] = []
    for kind in kinds:
        registry = plugins.registry(kind)
        try:
            found = registry.plugins()
        except plugins.DuplicatePluginError as e:
            errors.append(str(e))
            continue
        rows += [{"kind": kind, "name": name, "target": p.target, "distribution": p.source,
                  "description": registry.describe(name)} for name, p in found.items()]
        empty.extend([] if found else [kind])
    if args.json:
        for row in rows:
            print(json.dumps(row, ensure_ascii=False))
    else:
        _print_table(rows, kinds, empty)
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


def _print_table(rows: list[dict[str, str]], kinds: list[str], empty: list[str]) -> None:
    from closedloop.terminal import make_console
    from rich.table import Table

    table = Table(title="plugins" if len(kinds) > 1 else f"plugins: {kinds[0]} ({plugins.KINDS[kinds[0]].group})")
    for column in ("kind", "name", "entry point", "from", "description"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["kind"], row["name"], row["target"], row["distribution"], row["description"])
    for kind in empty:
        table.add_row(kind, "[dim](none installed)[/dim]", "", "", "")
    make_console().print(table)
