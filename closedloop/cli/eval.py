"""``closedloop eval <benchmark>``: evaluate an agent on a benchmark (τ-bench, KernelBench, FactGuard or any installed one).

Each benchmark is a plugin: an entry point of ``closedloop.benchmarks`` naming a
``register(subparsers)`` hook that adds the benchmark's parser and its ``func``; a package adds one
with ``[project.entry-points."closedloop.benchmarks"] name = "module:register"``. Only the chosen
benchmark's hook is imported, and a hook's module imports only what its parser needs (its handler
imports the machinery when it runs), so ``closedloop eval tau --help`` does not load KernelBench.
"""

from __future__ import annotations

import argparse

from closedloop import plugins
from closedloop.cli.lazy import lazy_subparsers

GROUP = "closedloop.benchmarks"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", description=__doc__.splitlines()[0])
    bench = lazy_subparsers(p, dest="benchmark", required=True, metavar="BENCHMARK")
    bench.add_plugins(plugins.registry(GROUP))
