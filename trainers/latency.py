"""Latency-aware GRPO (paper 7, the Hibiki-Zero recipe on text): SFT on delayed targets, then GRPO
with a reward that pays for translations that are correct *and* early.

The environment is ``simul`` (:mod:`closedloop.evals.envs.simul`): source words arrive one per
step, the policy writes target words or waits, and the reward per source sentence is BLEU of what
was written by the sentence's deadline minus a DAL lag cost. The recipe:

1. SFT on the scripted ``delayed`` expert: each sentence's translation written only when its last
   source word has arrived, plus up to ``extra_delay`` silent steps (Hibiki's silence insertion):
   high latency, full quality;
2. GRPO (:func:`closedloop.trainers.grpo.train_grpo`, env ``simul``) from the SFT model;
3. greedy evaluation of both on held-out seeds (BLEU, AL, LAAL, DAL, end offset), next to the
   analytic wait-k baselines, the delayed expert and the oracle (every word at the earliest step
   it is known) on the same sentences.

``python -m closedloop.trainers.latency [--out DIR] [--set key=value ...]`` runs it and prints the
table; ``results.json`` holds every number. Latency-aware GRPO on its own is
``closedloop train grpo --set env=simul --set model=SFT_DIR ...``: the latency-awareness lives in
the environment's reward, not in a separate loss.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LatencyConfig", "run_latency_experiment", "evaluate_policy", "baselines", "main"]

METRICS = ("bleu", "al", "laal", "dal", "end_offset", "reward")


class LatencyConfig(BaseModel):
    """Every knob of the experiment; the defaults are the reported run (about 15 minutes on a shared 2-core CPU)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., description="Base model directory (the tiny model).")
    out: str = Field("out/latency", description="Output folder (models, results.json).")
    store: str | None = Field(None, description="Run store file (default: <out>/runs.duckdb).")
    level: int = Field(1, ge=1, description="Sentences per episode.")
    delta: int = Field(1, ge=0, description="Deadline slack after each sentence's end (steps).")
    lag_weight: float = Field(0.5, ge=0, description="Weight of the DAL/|x| lag cost in the reward.")
    extra_delay: int = Field(1, ge=0, description="SFT data: up to this many extra silent steps per sentence.")
    expert_episodes: int = Field(400, ge=1, description="Delayed expert episodes for SFT.")
    sft_steps: int = Field(1000, ge=1, description="SFT optimizer steps.")
    sft_learning_rate: float = Field(4e-3, gt=0, description="SFT peak learning rate (cosine).")
    sft_batch_size: int = Field(16, ge=1, description="SFT examples per step.")
    grpo_steps: int = Field(30, ge=1, description="GRPO steps.")
    grpo_learning_rate: float = Field(1e-4, gt=0, description="GRPO learning rate (constant).")
    prompts_per_step: int = Field(8, ge=1, description="GRPO initial states per step.")
    num_generations: int = Field(8, ge=2, description="GRPO group size.")
    temperature: float = Field(1.0, gt=0, description="GRPO sampling temperature.")
    beta: float = Field(0.0, ge=0, description="k3 KL to the SFT model (paper 7 keeps one).")
    max_new_tokens: int = Field(16, ge=1, description="Tokens per step.")
    eval_episodes: int = Field(100, ge=1, description="Held-out greedy episodes per policy.")
    eval_seed_start: int = Field(10_000_000, description="First held-out seed.")
    grpo_seed_start: int = Field(1_000_000, description="First GRPO training seed.")
    sft_model: str | None = Field(None, description="Start GRPO from this SFT model directory (skips SFT).")
    seed: int = Field(0, description="Training seed.")
    torch_threads: int = Field(1, ge=1, description="torch threads.")


def _env_options(cfg: LatencyConfig, **extra: Any) -> dict[str, Any]:
    return {"level": cfg.level, "delta": cfg.delta, "lag_weight": cfg.lag_weight, **extra}


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(float(r.get(key, 0.0) or 0.0) for r in rows) / max(len(rows), 1)


def baselines(cfg: LatencyConfig) -> dict[str, dict[str, float]]:
    """Wait-k (k = 1..4), the delayed expert (the SFT targets, without extra delay) and the oracle,
    scored analytically on the evaluation sentences."""
    import random

    from closedloop.evals.envs.simul import (delayed_emissions, make_sentence, oracle_emissions, score_emissions,
                                             wait_k_emissions)

    policies: dict[str, Callable[[Any], Any]] = {f"wait-{k}": (lambda s, k=k: wait_k_emissions(s, k))
                                                 for k in range(1, 5)}
    policies.update({"delayed": delayed_emissions, "oracle": oracle_emissions})
    out: dict[str, dict[str, float]] = {}
    for name, policy in policies.items():
        rows = []
        for seed in range(cfg.eval_seed_start, cfg.eval_seed_start + cfg.eval_episodes):
            rng = random.Random(seed)
            sentences = [make_sentence(rng) for _ in range(cfg.level)]  # as SimulEnv._setup draws them
            sc = score_emissions(policy(sentences), sentences, delta=cfg.delta, lag_weight=cfg.lag_weight)
            rows.append({**sc.metrics(), "reward": sc.quality + sc.lag})
        out[name] = {k: _mean(rows, k) for k in METRICS}
    return out


def evaluate_policy(model_dir: str | Path, cfg: LatencyConfig) -> dict[str, float]:
    """Greedy held-out episodes of ``simul`` with the react graph: mean BLEU, AL, LAAL, DAL, end offset, reward."""
    from closedloop.evals.envs import make_env
    from closedloop.models.base import SamplingParams
    from closedloop.models.hf import HFClient
    from closedloop.trainers.evaluate import aevaluate

    client = HFClient.from_pretrained(str(model_dir), max_batch_size=64)
    seeds = range(cfg.eval_seed_start, cfg.eval_seed_start + cfg.eval_episodes)
    opts = _env_options(cfg)
    _, episodes = asyncio.run(aevaluate(client, lambda: make_env("simul", **opts), seeds, name=str(model_dir),
                                        params=SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens),
                                        max_steps=5 * cfg.level + 2))
    rows = [{**e.info, "reward": e.reward} for e in episodes]
    return {k: _mean(rows, k) for k in METRICS}


def run_latency_experiment(cfg: LatencyConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    from closedloop.trainers.grpo import GRPOConfig, train_grpo

    torch.set_num_threads(cfg.torch_threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    store = cfg.store or str(out / "runs.duckdb")
    times: dict[str, float] = {}
    t = time.perf_counter()
    sft_dir = Path(cfg.sft_model) if cfg.sft_model else _sft(cfg, out, store)
    times["sft"] = time.perf_counter() - t
    t = time.perf_counter()
    grpo = train_grpo(GRPOConfig(model=str(sft_dir), output_dir=str(out / "grpo"), env="simul",
                                 env_options=_env_options(cfg), max_steps=cfg.grpo_steps,
                                 learning_rate=cfg.grpo_learning_rate, lr_scheduler="constant",
                                 prompts_per_step=cfg.prompts_per_step, num_generations=cfg.num_generations,
                                 temperature=cfg.temperature, beta=cfg.beta, max_env_steps=5 * cfg.level + 2,
                                 max_new_tokens=cfg.max_new_tokens, train_seed_start=cfg.grpo_seed_start,
                                 per_device_batch_size=16, seed=cfg.seed, store=store, tags=["latency"],
                                 save_steps=None, torch_threads=cfg.torch_threads,
                                 logging_steps=max(1, cfg.grpo_steps // 10), run_name="latency-grpo"))
    times["grpo"] = time.perf_counter() - t
    t = time.perf_counter()
    policies = {"sft": evaluate_policy(sft_dir, cfg), "grpo": evaluate_policy(grpo.output_dir, cfg)}
    times["eval"] = time.perf_counter() - t
    result = {"config": cfg.model_dump(), "policies": policies, "baselines": baselines(cfg),
              "grpo_history": [{k: h.get(k) for k in ("step", "reward", "rewards/quality", "rewards/lag")}
                               for h in grpo.history], "seconds": times}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    _print(result)
    return result


def _sft(cfg: LatencyConfig, out: Path, store: str) -> Path:
    """SFT on the delayed expert (Hibiki's delayed targets)."""
    from closedloop.evals.envs.experts import expert_trajectories
    from closedloop.trainers.config import SFTConfig
    from closedloop.trainers.sft import train_sft

    experts = expert_trajectories("simul", range(cfg.expert_episodes), level=cfg.level,
                                  **{k: v for k, v in _env_options(cfg).items() if k != "level"},
                                  expert="delayed", expert_extra_delay=cfg.extra_delay)
    sft = train_sft(SFTConfig(model=cfg.model, output_dir=str(out / "sft"), max_steps=cfg.sft_steps,
                              learning_rate=cfg.sft_learning_rate, lr_scheduler="cosine",
                              warmup_steps=max(1, cfg.sft_steps // 20), per_device_batch_size=cfg.sft_batch_size,
                              seed=cfg.seed, save_steps=None, store=store, tags=["latency"],
                              torch_threads=cfg.torch_threads, logging_steps=max(1, cfg.sft_steps // 5),
                              run_name="latency-sft"), experts)
    return Path(sft.output_dir)


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="simul: held-out greedy episodes (lag in source words)")
    table.add_column("policy")
    for k in METRICS:
        table.add_column(k, justify="right")
    for group in ("policies", "baselines"):
        for name, m in result[group].items():
            table.add_row(name, *[f"{m[k]:.3f}" for k in METRICS])
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    import os

    p = argparse.ArgumentParser(prog="python -m closedloop.trainers.latency", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.environ.get("CLOSEDLOOP_TINY_MODEL"), help="base model directory")
    p.add_argument("--out", default="out/latency")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if not args.model:
        p.error("--model (or $CLOSEDLOOP_TINY_MODEL) is required")
    import yaml

    values: dict[str, Any] = {"model": args.model, "out": args.out}
    for item in args.overrides:
        key, _, raw = item.partition("=")
        values[key.strip()] = yaml.safe_load(raw)
    run_latency_experiment(LatencyConfig(**values))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
