"""The RFT generalisation protocol (paper 5) on the built-in environments with the tiny model.

1. A warm start: the tiny model after a short SFT on scripted-expert episodes of ``calc`` (level 1),
   ``clarify`` (level 1) and ``simul`` (one sentence, delayed expert), so every environment starts
   from a partial, non-zero score (RL has something to reinforce);
2. ``sequential``: GRPO on calc-L1, then on clarify-L1 (``steps`` steps each);
3. ``mixture``: GRPO on calc-L1 and clarify-L1 mixed 1:1 for ``2 × steps`` steps (same budget);
4. each evaluated after every stage on held-out seeds of calc-L1, clarify-L1 and the held-out
   simul-L1 and calc-L2 (the harder level of a trained environment: paper 5's easy → hard axis):
   the matrix, transfer and forgetting (:mod:`closedloop.trainers.rft`).

    python benchmarks/rft_matrix.py --model $CLOSEDLOOP_TINY_MODEL --out out/rft --steps 12

Writes ``<out>/<mode>/matrix.{json,png}`` and ``<out>/summary.json``. Scores: success rate
(calc, clarify) or mean reward (simul: BLEU-by-deadline − lag). With ``eval_episodes`` held-out
episodes a success rate's 95% interval is about ±1/sqrt(eval_episodes): read small differences
as noise.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.environ.get("CLOSEDLOOP_TINY_MODEL"), help="base model directory")
    p.add_argument("--out", default="out/rft")
    p.add_argument("--steps", type=int, default=12, help="GRPO steps per sequential stage")
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--eval-episodes", type=int, default=48)
    p.add_argument("--modes", default="sequential,mixture")
    p.add_argument("--prompts", type=int, default=8, help="GRPO prompts per step")
    p.add_argument("--group", type=int, default=8, help="GRPO group size")
    args = p.parse_args()
    if not args.model:
        p.error("--model (or $CLOSEDLOOP_TINY_MODEL) is required")
    import torch

    torch.set_num_threads(1)
    from closedloop.evals.envs.experts import expert_trajectories
    from closedloop.trainers.config import SFTConfig
    from closedloop.trainers.rft import RFTConfig, run_rft
    from closedloop.trainers.sft import train_sft

    out = Path(args.out)
    store = str(out / "runs.duckdb")
    warm = out / "warm"
    if not (warm / "model.safetensors").exists():
        data = (expert_trajectories("calc", range(160), level=1)
                + expert_trajectories("clarify", range(80), level=1)
                + expert_trajectories("simul", range(80), level=1, expert="delayed"))
        train_sft(SFTConfig(model=args.model, output_dir=str(warm), max_steps=args.sft_steps, learning_rate=3e-3,
                            lr_scheduler="cosine", warmup_steps=3, per_device_batch_size=16, save_steps=None,
                            store=store, torch_threads=1, logging_steps=10, run_name="rft-warm", seed=0), data)
    calc1 = {"name": "calc", "options": {"level": 1}, "max_env_steps": 4}
    clar1 = {"name": "clarify", "options": {"level": 1}, "max_env_steps": 5}
    evals = [calc1, clar1, {"name": "simul", "options": {"level": 1}, "max_env_steps": 6},
             {"name": "calc", "options": {"level": 2}, "max_env_steps": 5}]
    common = dict(model=str(warm), store=store, eval_envs=evals, prompts_per_step=args.prompts,
                  num_generations=args.group,
                  max_env_steps=5, max_new_tokens=48, eval_episodes=args.eval_episodes, learning_rate=3e-4,
                  lr_scheduler="constant", torch_threads=1, save_steps=None, logging_steps=4, per_device_batch_size=16)
    summary = {}
    for mode in args.modes.split(","):
        cfg = RFTConfig(output_dir=str(out / mode), mode=mode, envs=[calc1, clar1],
                        steps_per_stage=args.steps * (2 if mode == "mixture" else 1), **common)
        summary[mode] = run_rft(cfg).matrix.as_dict()
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
