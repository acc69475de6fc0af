"""Constrained GRPO experiment: an unconstrained run violates a cost budget, the constrained run
(Lagrange multiplier, dual ascent) meets it; how much task reward does meeting it cost?

Setup: the tiny model (built here, or ``--model``; ``--sft-steps`` first imitates expert episodes,
as ``closedloop demo`` does) on ``calc`` (react graph as the policy), the
same seeds, steps and settings for every run; ``--cost`` / ``--budget`` name the constraint
(default: expected policy turns per episode). Runs: ``unconstrained`` and ``constrained`` (and,
with ``--fixed-penalty X``, GRPO with a fixed penalty weight X on the same cost for comparison).
Each trained policy is then evaluated on held-out seeds (sampling at ``--eval-temperature``): success, reward, mean cost.

    python benchmarks/bench_constrained_grpo.py --steps 30 --budget 1.8
    python benchmarks/bench_constrained_grpo.py --cost tool_calls --budget 0.8 --steps 40

Reported: per run, the last-window training means (reward, cost, λ) and the held-out numbers;
the "reward loss" is the constrained run's held-out reward minus the unconstrained run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def train(name: str, model: str, out: Path, args: argparse.Namespace, constraints: list[dict[str, Any]],
          weights: dict[str, float], funcs: list[str]) -> dict[str, Any]:
    from closedloop.trainers.config import load_config
    from closedloop.trainers.grpo import GRPOConfig, train_grpo

    cfg = load_config(GRPOConfig, None, [
        f"model={model}", f"output_dir={out / name}", "env=calc",
        f"env_options={{level: {args.level}, turn_cost: {args.turn_cost}, format_weight: {args.format_weight}}}",
        f"max_steps={args.steps}", f"learning_rate={args.lr}", "lr_scheduler=constant",
        f"prompts_per_step={args.prompts}", f"num_generations={args.generations}", "report_to=none",
        "per_device_batch_size=16", "torch_threads=1", f"seed={args.seed}", "train_seed_start=1000000",
        f"temperature={args.temperature}", "logging_steps=1000", f"scale_rewards={args.scale_rewards}"],
        constraints=constraints, reward_weights=weights, reward_funcs=funcs)
    t = time.perf_counter()
    result = train_grpo(cfg)
    window = result.history[-args.window:]
    key = f"constraint/{args.cost.replace(':', '_')}"

    def mean(k: str) -> float:
        vals = [h[k] for h in window if k in h]
        return statistics.fmean(vals) if vals else float("nan")

    return {"name": name, "dir": str(out / name), "seconds": time.perf_counter() - t,
            "train_reward": mean("reward"), "train_success": mean("rewards/success"),
            "train_turns": mean("turns_mean"), "train_cost": mean(f"{key}/cost"), "lambda": mean(f"{key}/lambda"),
            "history": [{k: h[k] for k in h if k in ("step", "reward", "turns_mean", "rewards/success")
                         or k.startswith("constraint/")} for h in result.history]}


def sft(model: str, out: Path, args: argparse.Namespace) -> str:
    from closedloop.evals.envs.experts import expert_trajectories
    from closedloop.trainers.config import SFTConfig
    from closedloop.trainers.sft import train_sft

    experts = expert_trajectories("calc", range(200), level=args.level)
    cfg = SFTConfig(model=model, output_dir=str(out / "sft"), max_steps=args.sft_steps, learning_rate=args.sft_lr,
                    lr_scheduler="cosine", warmup_steps=1, per_device_batch_size=16, seed=args.seed, save_steps=None,
                    report_to=[], torch_threads=1, logging_steps=max(1, args.sft_steps))
    return str(train_sft(cfg, experts).output_dir)


def evaluate(model_dir: str, args: argparse.Namespace) -> dict[str, float]:
    from closedloop.evals.envs import make_env
    from closedloop.models.hf import HFClient
    from closedloop.trainers.constrained import CostConstraint, episode_cost
    from closedloop.trainers.evaluate import evaluate as run_eval

    from closedloop.models.base import SamplingParams

    client = HFClient.from_pretrained(model_dir, max_batch_size=64)
    seeds = range(10_000_000, 10_000_000 + args.eval_episodes)
    params = SamplingParams(temperature=args.eval_temperature, max_tokens=64, seed=args.seed)
    env = {"level": args.level, "turn_cost": args.turn_cost, "format_weight": args.format_weight}
    summary, episodes = run_eval(client, lambda: make_env("calc", **env), seeds, name="eval",
                                 params=params)
    c = CostConstraint(cost=args.cost, budget=args.budget)
    costs = [episode_cost(c, e.trajectory, e.info) for e in episodes]
    rewards = [sum(e.trajectory.rewards.values()) for e in episodes]
    out = summary.as_dict()
    return {"success": out["success"], "ci_low": out["ci_low"], "ci_high": out["ci_high"],
            "reward": statistics.fmean(rewards), "cost": statistics.fmean(costs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: build the tiny model)")
    p.add_argument("--tiny-steps", type=int, default=500, help="warm-up steps when building the tiny model")
    p.add_argument("--sft-steps", type=int, default=0, help="first SFT the model on expert calc episodes (as the demo)")
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--cost", default="turns")
    p.add_argument("--budget", type=float, default=1.8)
    p.add_argument("--multiplier-lr", type=float, default=0.5)
    p.add_argument("--multiplier-max", type=float, default=100.0, help="upper clip of λ")
    p.add_argument("--runs", default="unconstrained,constrained", help="which runs (comma list; 'fixed' needs "
                                                                        "--fixed-penalty)")
    p.add_argument("--fixed-penalty", type=float, default=None, help="also run GRPO with this fixed penalty weight")
    p.add_argument("--level", type=int, default=1)
    p.add_argument("--turn-cost", type=float, default=0.0, help="calc's per-action cost (its default 0.01 already "
                   "rewards fewer turns; 0 leaves the budget as the only pressure on turns)")
    p.add_argument("--format-weight", type=float, default=0.0, help="calc's format reward (default 0 here: the "
                   "reward is success alone, which needs the tool turn)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--window", type=int, default=10, help="last steps averaged for the training numbers")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"],
                   help="GRPO advantage scaling; with 'none' the penalty's size (λ) counts, not only its ranking")
    p.add_argument("--eval-episodes", type=int, default=200)
    p.add_argument("--eval-temperature", type=float, default=1.0, help="held-out evaluation sampling temperature "
                   "(default: the training temperature, since the budget bounds the sampling policy's expected "
                   "cost; 0 = greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="keep models and results.json here (default: a temporary folder)")
    args = p.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(1)
    console = Console(width=150)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = args.model
        if model is None:
            from closedloop.models.tiny import build_tiny_model

            console.print(f"building the tiny model ({args.tiny_steps} warm-up steps) ...")
            model = str(build_tiny_model(out / "tiny", train_steps=args.tiny_steps))
        if args.sft_steps:
            model = sft(model, out, args)
            console.print(f"SFT: {args.sft_steps} steps on expert calc episodes -> {model}")
        constraint = {"cost": args.cost, "budget": args.budget, "multiplier_lr": args.multiplier_lr,
                      "multiplier_max": args.multiplier_max}
        monitor = {**constraint, "multiplier_max": 0.0}  # logs the cost, λ stays 0
        runs = [("unconstrained", [monitor], {}, []), ("constrained", [constraint], {}, [])]
        if args.fixed_penalty is not None:
            from closedloop.trainers.constrained import BUILTIN_COSTS

            if args.cost not in BUILTIN_COSTS:
                p.error("--fixed-penalty supports the built-in costs only")
            fn = {"turns": "num_turns", "completion_tokens": "completion_tokens", "latency_s": "latency_s"}.get(args.cost)
            if fn is None:
                p.error(f"--fixed-penalty: no reward function for {args.cost}")
            runs.append((f"fixed penalty {args.fixed_penalty}", [monitor], {fn: -args.fixed_penalty},
                         [f"closedloop.trainers.rewards:{fn}"]))
        wanted = set(args.runs.split(","))
        runs = [r for r in runs if r[0].split(" ")[0] in wanted or (r[0].startswith("fixed") and "fixed" in wanted)]
        results = []
        base_eval = evaluate(model, args)
        for name, cons, weights, funcs in runs:
            console.print(f"[bold]{name}[/]: {args.steps} GRPO steps")
            r = train(name.replace(" ", "_"), model, out, args, cons, weights, funcs)
            r["name"] = name
            r["eval"] = evaluate(r["dir"], args)
            results.append(r)
        table = Table(title=f"calc level {args.level}: budget E[{args.cost}] <= {args.budget}; {args.steps} steps x "
                            f"{args.prompts}x{args.generations} episodes; held-out eval on "
                            f"{args.eval_episodes} seeds at T={args.eval_temperature}")
        for col in ("run", f"train {args.cost} (last {args.window})", "train reward", "lambda", f"eval {args.cost}",
                    "eval reward", "eval success [95% CI]", "s"):
            table.add_column(col, justify="left" if col == "run" else "right")
        table.add_row("start model", "", "", "", f"{base_eval['cost']:.3f}", f"{base_eval['reward']:.3f}",
                      f"{base_eval['success']:.3f} [{base_eval['ci_low']:.2f}, {base_eval['ci_high']:.2f}]", "")
        for r in results:
            e = r["eval"]
            table.add_row(r["name"], f"{r['train_cost']:.3f}", f"{r['train_reward']:.3f}", f"{r['lambda']:.3f}",
                          f"{e['cost']:.3f}", f"{e['reward']:.3f}",
                          f"{e['success']:.3f} [{e['ci_low']:.2f}, {e['ci_high']:.2f}]", f"{r['seconds']:.0f}")
        console.print(table)
        for r in results:
            console.print(f"{r['name']}: held-out E[{args.cost}] = {r['eval']['cost']:.3f} "
                          f"({'meets' if r['eval']['cost'] <= args.budget else 'violates'} the budget); training "
                          f"(sampled, last {args.window} steps) {r['train_cost']:.3f}")
        (out / "results.json").write_text(json.dumps({"args": vars(args), "base": base_eval, "runs": results},
                                                     indent=1))


if __name__ == "__main__":
    main()
