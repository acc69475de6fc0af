"""The information-gain clarifier experiment on the built-in ``clarify`` environment.

From one SFT start (the tiny model imitating the scripted max-IG expert for a few steps), two
GRPO runs with identical seeds and settings except the reward:

- ``success``: success − cost per turn (the information-gain component weighs 0);
- ``ig``: the same plus the exact per-turn information gain (nats) as a per-turn reward, credited
  to the turn that asked (turn-level advantages, ``turn_reward_components=[info_gain]``).

All three policies are then evaluated greedily on held-out seeds: success (Wilson 95% CI), mean
questions, mean uninformative questions (questions whose answer did not shrink the candidate
set: exact IG = 0). The paper's claim, in sign: the IG-trained policy asks fewer uninformative
questions at equal or better success.

    python benchmarks/bench_clarify_ig.py --out out/clarify-ig            # ~10 min on 2 CPU cores
    python benchmarks/bench_clarify_ig.py --quick                         # a smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/clarify-ig")
    ap.add_argument("--model", default=None, help="base model directory (default: build the tiny model)")
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--expert-episodes", type=int, default=400)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--ig-weight", type=float, default=0.5, help="reward per nat of information gain (ig run)")
    ap.add_argument("--eval-episodes", type=int, default=200)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.expert_episodes, args.sft_steps, args.grpo_steps, args.eval_episodes = 60, 10, 2, 20

    import torch
    from rich.console import Console
    from rich.table import Table

    from closedloop.evals.envs import make_env
    from closedloop.evals.envs.experts import expert_trajectories
    from closedloop.models.hf import HFClient
    from closedloop.models.tiny import build_tiny_model
    from closedloop.trainers.config import SFTConfig
    from closedloop.trainers.evaluate import evaluate
    from closedloop.trainers.grpo import GRPOConfig, train_grpo
    from closedloop.trainers.sft import train_sft

    torch.set_num_threads(1)
    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base = Path(args.model) if args.model else out / "base"
    if not args.model and not (base / "config.json").exists():
        build_tiny_model(base, seed=0, train_steps=300 if args.quick else 1000)
    experts = expert_trajectories("clarify", range(args.expert_episodes), level=args.level)
    sft = train_sft(SFTConfig(model=str(base), output_dir=str(out / "sft"), max_steps=args.sft_steps,
                              learning_rate=3e-3, lr_scheduler="cosine", warmup_steps=max(1, args.sft_steps // 20),
                              per_device_batch_size=16, save_steps=None, report_to="none", torch_threads=1,
                              max_length=2048), experts)
    runs = {}
    for name, weight, turn in (("success", 0.0, []), ("ig", args.ig_weight, ["info_gain"])):
        cfg = GRPOConfig(model=str(sft.output_dir), output_dir=str(out / f"grpo-{name}"), env="clarify",
                         env_options={"level": args.level, "info_gain_weight": weight},
                         turn_reward_components=turn, max_steps=args.grpo_steps, learning_rate=args.lr,
                         lr_scheduler="constant", prompts_per_step=8, num_generations=8, max_env_steps=6,
                         max_new_tokens=48, per_device_batch_size=16, seed=0, train_seed_start=1_000_000,
                         report_to="none", save_steps=None, torch_threads=1)
        runs[name] = train_grpo(cfg)
    rows = []
    seeds = range(10_000_000, 10_000_000 + args.eval_episodes)
    for name, path in (("sft", sft.output_dir), ("grpo-success", runs["success"].output_dir),
                       ("grpo-ig", runs["ig"].output_dir)):
        client = HFClient.from_pretrained(path, max_batch_size=64)
        summary, _ = evaluate(client, lambda: make_env("clarify", level=args.level), seeds, name=name,
                              max_steps=6, extra_keys=("questions", "uninformative_questions"))
        rows.append(summary.as_dict())
    table = Table(title=f"clarify level {args.level}: {args.eval_episodes} held-out episodes (greedy)")
    for col in ("policy", "success", "95% CI", "questions", "uninformative", "turns"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], f"{r['success']:.3f}", f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]",
                      f"{r['questions']:.2f}", f"{r['uninformative_questions']:.2f}", f"{r['mean_turns']:.2f}")
    console.print(table)
    (out / "results.json").write_text(json.dumps({"rows": rows, "args": vars(args),
                                                  "seconds": time.perf_counter() - t0}, indent=2))
    console.print(f"results: {out / 'results.json'} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
