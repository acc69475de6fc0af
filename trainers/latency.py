"""Latency-aware GRPO (paper 7, the Hibiki-Zero recipe on text): SFT on delayed targets, then GRPO
with a reward that pays for translations that are correct *and* early.

The environment is ``simul`` (:mod:`closedloop.evals.envs.simul`): source words arrive one per
step, the policy writes target words or waits, and the reward per source sentence is BLEU of what
was written by the sentence's deadline minus a DAL lag cost. The pipeline is the built-in recipe
``latency`` (``trainers/recipes/latency.yaml``):

1. SFT on the scripted ``delayed`` expert: each sentence's translation written only when its last
   source word has arrived, plus up to ``extra_delay`` silent steps (Hibiki's silence insertion):
   high latency, full quality;
2. GRPO (env ``simul``) from the SFT model;
3. greedy evaluation of both on held-out seeds (BLEU, AL, LAAL, DAL, end offset), next to the
   analytic wait-k baselines, the delayed expert and the oracle (every word at the earliest step
   it is known) on the same sentences: this module's :data:`REPORT` stage.

``closedloop recipe run latency --set model=DIR [--set out=DIR] [--set key=value ...]`` runs it and
prints the table; ``results.json`` holds every number. Latency-aware GRPO on its own is
``closedloop train grpo --set env=simul --set model=SFT_DIR ...``: the latency-awareness lives in
the environment's reward, not in a separate loss.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from closedloop.trainers.recipes.runner import StageContext, StageKind

__all__ = ["METRICS", "SimulTask", "LatencyReport", "REPORT", "baselines"]

METRICS = ("bleu", "al", "laal", "dal", "end_offset", "reward")


class SimulTask(BaseModel):
    """The evaluation sentences: the ``simul`` options and the held-out seeds."""

    model_config = ConfigDict(extra="forbid")

    level: int = Field(1, ge=1, description="Sentences per episode.")
    delta: int = Field(1, ge=0, description="Deadline slack after each sentence's end (steps).")
    lag_weight: float = Field(0.5, ge=0, description="Weight of the DAL/|x| lag cost in the reward.")
    eval_episodes: int = Field(100, ge=1, description="Held-out episodes.")
    eval_seed_start: int = Field(10_000_000, description="First held-out seed.")


class LatencyReport(SimulTask):
    """The recipe's last stage: baselines beside the evaluated policies, ``results.json`` and the table."""

    results: str = Field(..., description="Where results.json goes.")
    policies: dict[str, dict[str, Any]] = Field(..., description="Policy -> evaluation summary (evaluate stage).")
    grpo_history: list[dict[str, Any]] = Field(default_factory=list, description="GRPO metrics per step.")
    params: dict[str, Any] = Field(default_factory=dict, description="The recipe's params, kept in results.json.")
    seconds: dict[str, float] = Field(default_factory=dict, description="Time per stage.")


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(float(r.get(key, 0.0) or 0.0) for r in rows) / max(len(rows), 1)


def baselines(cfg: SimulTask) -> dict[str, dict[str, float]]:
    """Wait-k (k = 1..4), the delayed expert (the SFT targets, without extra delay) and the oracle,
    scored analytically on the evaluation sentences."""
    import random

    from closedloop.evals.envs.simul import (delayed_emissions, make_sentence, oracle_emissions, score_emissions,
                                             wait_k_emissions)

    policies: dict[str, Callable[[Any], Any]] = {f"wait-{k}": functools.partial(wait_k_emissions, k=k)
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


def _report(config: LatencyReport, ctx: StageContext) -> dict[str, Any]:
    policies = {name: {k: float(s["mean_reward"] if k == "reward" else s.get(k, 0.0)) for k in METRICS}
                for name, s in config.policies.items()}
    result = {"config": config.params, "policies": policies, "baselines": baselines(config),
              "grpo_history": [{k: h.get(k) for k in ("step", "reward", "rewards/quality", "rewards/lag")}
                               for h in config.grpo_history], "seconds": config.seconds}
    Path(config.results).write_text(json.dumps(result, indent=2))
    _print(result)
    return {"results": config.results, "policies": policies}


REPORT = StageKind(LatencyReport, _report, "baselines, results.json and the table")
