"""``closedloop demo``: the main job — build the tiny model, SFT on expert ``calc`` trajectories,
GRPO on rollouts of the ``react`` graph, then evaluate base, SFT and GRPO on held-out seeds.

Thin: the pipeline is :func:`closedloop.trainers.demo.run_demo` (imported only when the command
runs, so the core CLI never imports trainers at start-up).
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the closed loop end to end: tiny model → SFT → GRPO → held-out evaluation",
                       description="Build (or take) a model, SFT it on expert calc trajectories, GRPO it on rollouts "
                                   "of the react graph, and compare base, SFT and GRPO on held-out seeds.")
    p.add_argument("--out", default=None, help="output folder (default out/demo)")
    p.add_argument("--model", default=None, help="base model as hf:PATH instead of building the tiny model")
    p.add_argument("--rollout-model", default=None, help="GRPO rollouts from another engine (vllm:PATH on a GPU)")
    p.add_argument("--store", default=None, help="run store file (default <out>/runs.duckdb)")
    p.add_argument("--quick", action="store_true", help="a scaled-down run (what CI executes): same stages, fewer steps")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a demo setting (see --list-keys); repeatable")
    p.add_argument("--list-keys", action="store_true", help="list the demo settings with defaults and exit")
    p.set_defaults(func=handle)


def _config(args: argparse.Namespace) -> Any:
    import yaml

    from closedloop.trainers.demo import DemoConfig

    values: dict[str, Any] = {}
    for item in args.overrides:
        key, sep, raw = item.partition("=")
        if not sep or key not in DemoConfig.model_fields:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY one of {sorted(DemoConfig.model_fields)}")
        values[key] = yaml.safe_load(raw)
    for key in ("out", "model", "rollout_model", "store"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    return DemoConfig.quick(**values) if args.quick else DemoConfig(**values)


def handle(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    console = Console()
    if args.list_keys:
        from closedloop.trainers.demo import DemoConfig

        for name, field in DemoConfig.model_fields.items():
            console.print(f"[bold]{name}[/bold] ({field.default!r}): {field.description}")
        return 0
    try:
        cfg = _config(args)
    except (ValueError, ValidationError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    from closedloop.trainers.demo import run_demo

    console.rule("closedloop demo")
    result = run_demo(cfg, log=lambda s: console.print(f"[cyan]•[/cyan] {s}"))
    table = Table(title=f"{cfg.env} level {cfg.level}: {cfg.eval_episodes} held-out episodes per stage (greedy)")
    for col in ("stage", "success", "95% CI", "mean turns", "tokens / episode", "mean reward"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in result.stages:
        m = s.summary
        table.add_row(s.name, f"{m['success']:.3f}", f"[{m['ci_low']:.3f}, {m['ci_high']:.3f}]",
                      f"{m['mean_turns']:.2f}", f"{m['mean_tokens']:.1f}", f"{m['mean_reward']:.3f}")
    console.print(table)
    secs = " · ".join(f"{k} {v:.0f}s" for k, v in result.seconds.items())
    console.print(f"time: {secs}")
    console.print(f"plot: {result.plot}\nresults: {cfg.out}/results.json\nstore: {result.store} "
                  f"(closedloop runs list --store {result.store})")
    return 0


