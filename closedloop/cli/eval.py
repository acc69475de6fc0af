"""``closedloop eval <benchmark>``: each benchmark's subcommand comes from an entry point.

A package declares ``[project.entry-points."closedloop.benchmarks"] name = "module:register"``,
where ``register(subparsers)`` adds the benchmark's parser (and its ``func``). The core imports no
benchmark, so a new one needs no edit here. Built in: ``tau`` (τ²-bench), ``kernelbench``.
"""

from __future__ import annotations

import argparse
import sys

GROUP = "closedloop.benchmarks"


def register(sub: argparse._SubParsersAction) -> None:
    from closedloop.plugins import available

    p = sub.add_parser("eval", help="evaluate an agent on a benchmark (" + ", ".join(sorted(available(GROUP))) + ")")
    bench = p.add_subparsers(dest="benchmark", required=True)
    for name, ep in sorted(available(GROUP).items()):
        try:
            hook = ep.load()
        except Exception as e:  # noqa: BLE001 - one broken plugin must not take the CLI down
            broken = bench.add_parser(name, help=f"(unavailable: {type(e).__name__})")
            broken.set_defaults(func=_unavailable(name, e))
            continue
        hook(bench)


def _unavailable(name: str, exc: BaseException):
    def handle(args: argparse.Namespace) -> int:
        print(f"error: benchmark {name!r} could not be loaded: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2

    return handle
