"""Constrained GRPO experiment (recipe ``constrained_grpo.yaml``): an unconstrained run violates a
cost budget, the constrained run (Lagrange multiplier, dual ascent) meets it; how much task reward
does meeting it cost?

Setup: the tiny model (built here, or ``--set model=DIR``; ``--set sft_steps=N`` first imitates
expert episodes, as ``closedloop demo`` does) on ``calc`` (react graph as the policy), the same
seeds, steps and settings for every run; ``cost`` / ``budget`` name the constraint (default:
expected policy turns per episode). Runs: ``unconstrained`` and ``constrained`` (and, with
``--set runs=unconstrained,constrained,fixed --set fixed_penalty=X``, GRPO with a fixed penalty
weight X on the same cost for comparison). Each trained policy is then evaluated on held-out seeds
(sampling at ``eval_temperature``): success, reward, mean cost.

    closedloop recipe run benchmarks/recipes/constrained_grpo.yaml --set steps=30 --set budget=1.8
    closedloop recipe run benchmarks/recipes/constrained_grpo.yaml --set cost=tool_calls --set budget=0.8 --set steps=40

(Before the recipe this was ``python benchmarks/bench_constrained_grpo.py --steps 30 --budget 1.8``;
every flag is now a param of the same name, dashes as underscores.)

Reported: per run, the last-window training means (reward, cost, λ) and the held-out numbers;
the "reward loss" is the constrained run's held-out reward minus the unconstrained run's.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from closedloop.trainers.recipes import StageContext, StageKind


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[str]
    cost: str
    budget: float
    window: int
    results: str
    title: str
    params: dict[str, Any] = {}


def _train_means(history: list[dict[str, float]], window: int, cost: str) -> dict[str, float]:
    last = history[-window:]
    key = f"constraint/{cost.replace(':', '_')}"

    def mean(k: str) -> float:
        vals = [h[k] for h in last if k in h]
        return statistics.fmean(vals) if vals else float("nan")

    return {"train_reward": mean("reward"), "train_success": mean("rewards/success"), "train_turns": mean("turns_mean"),
            "train_cost": mean(f"{key}/cost"), "lambda": mean(f"{key}/lambda")}


def _report(config: Report, ctx: StageContext) -> dict[str, Any]:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    cost_key = f"cost/{config.cost.replace(':', '_')}"

    def held_out(summary: dict[str, Any]) -> dict[str, float]:
        return {"success": summary["success"], "ci_low": summary["ci_low"], "ci_high": summary["ci_high"],
                "reward": summary["mean_reward"], "cost": summary[cost_key]}

    base = held_out(ctx.outputs["eval-start"]["summaries"]["start"])
    runs = []
    for arm in config.arms:
        grpo = ctx.outputs[arm]
        runs.append({"name": arm, "dir": grpo["model_dir"], **_train_means(grpo["history"], config.window, config.cost),
                     "eval": held_out(ctx.outputs[f"eval-{arm}"]["summaries"][arm]),
                     "history": [{k: h[k] for k in h if k in ("step", "reward", "turns_mean", "rewards/success")
                                  or k.startswith("constraint/")} for h in grpo["history"]]})
    table = Table(title=escape(config.title))  # E[turns] is text, not a rich style
    for col in ("run", f"train {config.cost} (last {config.window})", "train reward", "lambda", f"eval {config.cost}",
                "eval reward", "eval success [95% CI]"):
        table.add_column(col, justify="left" if col == "run" else "right")
    table.add_row("start model", "", "", "", f"{base['cost']:.3f}", f"{base['reward']:.3f}",
                  f"{base['success']:.3f} [{base['ci_low']:.2f}, {base['ci_high']:.2f}]")
    for r in runs:
        e = r["eval"]
        table.add_row(r["name"], f"{r['train_cost']:.3f}", f"{r['train_reward']:.3f}", f"{r['lambda']:.3f}",
                      f"{e['cost']:.3f}", f"{e['reward']:.3f}", f"{e['success']:.3f} [{e['ci_low']:.2f}, {e['ci_high']:.2f}]")
    console = Console(width=150)
    console.print(table)
    for r in runs:
        verdict = "meets" if r["eval"]["cost"] <= config.budget else "violates"
        console.print(escape(f"{r['name']}: held-out E[{config.cost}] = {r['eval']['cost']:.3f} ({verdict} the "
                             f"budget); training (sampled, last {config.window} steps) {r['train_cost']:.3f}"))
    Path(config.results).write_text(json.dumps({"params": config.params, "base": base, "runs": runs}, indent=1))
    return {"results": config.results}


REPORT = StageKind(Report, _report, "the table and results.json")
