"""The executor flags of ``closedloop eval <benchmark>``: ``--executor {local,ray}``, ``--ray-address``,
``--ray-cpus``, ``--ray-gpus``.

Argparse only (the package's ``__init__`` imports lazily), so a benchmark's parser, built for
``--help``, imports no pydantic, asyncio machinery or Ray.
"""

from __future__ import annotations

import argparse

__all__ = ["EXECUTORS", "add_executor_arguments"]

EXECUTORS = ("local", "ray")


def add_executor_arguments(parser: argparse.ArgumentParser, *, per_item: str = "1 CPU slot") -> None:
    """Add the executor flags; ``per_item`` says what the benchmark's items ask by default (τ: one
    CPU slot for grading; KernelBench: one GPU per timed sample). ``--ray-cpus``/``--ray-gpus``
    replace only the part of that request they name."""
    g = parser.add_argument_group("executor", "where episodes run: this process (local) or a Ray cluster (ray)")
    g.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local: this process (the default); ray: tasks on a Ray cluster, results written here "
                        "(pip install 'closedloop[ray]')")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="the Ray cluster to join (auto, HOST:6379, ray://HOST:10001); default: $RAY_ADDRESS, else a "
                        "local Ray instance for this run")
    g.add_argument("--ray-cpus", type=float, metavar="N",
                   help=f"CPU slots per item on Ray, in place of that part of the default request ({per_item}); "
                        "fractions pack model-bound items")
    g.add_argument("--ray-gpus", type=float, metavar="N",
                   help=f"GPUs per item on Ray, in place of that part of the default request ({per_item})")

