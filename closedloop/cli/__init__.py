"""The ``closedloop`` command: a thin layer over the Python API.

Each subcommand is a plugin (an entry point of ``closedloop.commands``, see :mod:`closedloop.plugins`)
naming a ``register(subparsers)`` hook that adds its parser and sets ``func`` to a handler
``(args) -> int`` (the exit code). Only the chosen subcommand's module is imported
(:mod:`closedloop.cli.lazy`), so ``closedloop --help`` lists every command without importing torch,
DuckDB or LangGraph, and each command pays for its own machinery only.
"""

from __future__ import annotations

import argparse
import sys

# Not `from closedloop import plugins`: importing the subcommand module closedloop.cli.plugins rebinds
# the package's `plugins` attribute, which is this module's global of that name.
from closedloop.plugins import DuplicatePluginError, PluginNotFound, registry
from closedloop.cli.help import ClosedloopParser
from closedloop.cli.lazy import lazy_subparsers


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = ClosedloopParser(prog="closedloop", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('closedloop')}")
    sub = lazy_subparsers(parser, dest="command", required=True, metavar="COMMAND")
    commands = registry("commands")
    if not commands.names():
        raise PluginNotFound(f"no closedloop command found: {commands.missing_hint()}")
    sub.add_plugins(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except (DuplicatePluginError, PluginNotFound) as e:  # a clash, or no commands: say which
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    from closedloop.terminal import quiet_third_party

    quiet_third_party()  # transformers' and datasets' bars: our own progress says it once
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a store another process holds, or a bad --store path: one line, no traceback
        from closedloop.store import StoreBusyError, StoreOpenError

        if isinstance(e, StoreOpenError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        busy = StoreBusyError.within(e)
        if busy is None:
            raise
        print(f"error: {busy}", file=sys.stderr)
        return 75  # EX_TEMPFAIL: the same command can be run again later


if __name__ == "__main__":
    sys.exit(main())
