"""``closedloop demo``: the main job — build the tiny model, SFT on expert ``calc`` trajectories,
GRPO on rollouts of the ``react`` graph, then evaluate base, SFT and GRPO on held-out seeds.

Thin: the pipeline is the built-in recipe ``demo`` (``trainers/recipes/demo.yaml``, run by the
recipe runner, so a finished stage is skipped when the demo is run again); this command maps its
options onto the recipe's params and prints the table of ``results.json``. Nothing under
``closedloop.trainers`` is imported until the command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from closedloop.terminal import make_console
from closedloop.cli.recipe import add_run_arguments, run_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the closed loop end to end: tiny model → SFT → GRPO → held-out evaluation",
                       description="Build (or take) a model, SFT it on expert calc trajectories, GRPO it on rollouts "
                                   "of the react graph, and compare base, SFT and GRPO on held-out seeds "
                                   "(the built-in recipe `demo`).")
    p.add_argument("--out", default=None, help="output folder (default out/demo)")
    p.add_argument("--model", default=None, help="base model as hf:PATH instead of building the tiny model")
    p.add_argument("--rollout-model", default=None, help="GRPO rollouts from another engine (vllm:PATH on a GPU)")
    p.add_argument("--store", default=None, help="run store file (default <out>/runs.duckdb)")
    add_run_arguments(p, with_recipe=False)
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from closedloop.trainers.recipes import DEMO

    console = make_console()
    params = {k: getattr(args, k) for k in ("out", "model", "rollout_model", "store") if getattr(args, k) is not None}
    if not args.list_keys:
        console.rule("closedloop demo")
    result = run_from_args(DEMO, args, params, console=console, error=lambda s: console.print(f"[red]{s}[/red]"))
    if isinstance(result, int):
        return result
    values = json.loads((result.out / "recipe.json").read_text())["params"]
    _print_table(console, json.loads(Path(result.outputs["report"]["results"]).read_text()), values)
    return 0


def _print_table(console: Console, result: dict[str, Any], params: dict[str, Any]) -> None:
    table = Table(title=f"{params['env']} level {params['level']}: {params['eval_episodes']} held-out episodes per "
                        f"stage (greedy)")
    for col in ("stage", "success", "95% CI", "mean turns", "tokens / episode", "mean reward"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in result["stages"]:
        m = s["summary"]
        table.add_row(s["name"], f"{m['success']:.3f}", f"[{m['ci_low']:.3f}, {m['ci_high']:.3f}]",
                      f"{m['mean_turns']:.2f}", f"{m['mean_tokens']:.1f}", f"{m['mean_reward']:.3f}")
    console.print(table)
    secs = " · ".join(f"{k} {v:.0f}s" for k, v in result["seconds"].items())
    console.print(f"time: {secs}")
    console.print(f"plot: {result['plot']}\nresults: {params['out']}/results.json\nstore: {result['store']} "
                  f"(closedloop runs list --store {result['store']})")
