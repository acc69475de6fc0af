"""The ``closedloop`` command: a thin layer over the Python API.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds its parser
and sets ``func`` to a handler ``(args) -> int`` (the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ["run", "graphs", "serve", "model", "runs", "eval", "train", "demo", "recipe", "tool", "mcp"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="closedloop", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"closedloop.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"closedloop.cli.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a store another process holds: one line naming it, no traceback
        from closedloop.store import StoreBusyError

        busy = StoreBusyError.within(e)
        if busy is None:
            raise
        print(f"error: {busy}", file=sys.stderr)
        return 75  # EX_TEMPFAIL: the same command can be run again later


if __name__ == "__main__":
    sys.exit(main())
