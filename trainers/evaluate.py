"""Evaluate a policy (a graph on a model) on held-out environment seeds: success with a 95%
confidence interval, mean turns and tokens, so stages of a training run can be compared honestly.

Success is the environment's ``success`` reward component (1 for a solved episode); the interval
is Wilson's score interval, which stays inside [0, 1] and is sound at 0% or 100% success, where
the normal approximation collapses to a zero-width interval.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from closedloop.models.base import ModelClient, SamplingParams
from closedloop.trainers.rollout import EnvFactory, Episode, GraphPolicy, collect_groups


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (default 95%)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass
class EvalSummary:
    name: str
    episodes: int
    successes: int
    mean_reward: float
    mean_turns: float
    mean_tokens: float
    failed: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    @property
    def ci95(self) -> tuple[float, float]:
        return wilson_interval(self.successes, self.episodes)

    def as_dict(self) -> dict[str, Any]:
        lo, hi = self.ci95
        return {"name": self.name, "episodes": self.episodes, "success": self.success_rate, "ci_low": lo,
                "ci_high": hi, "mean_reward": self.mean_reward, "mean_turns": self.mean_turns,
                "mean_tokens": self.mean_tokens, "failed": self.failed, **self.extra}


def summarise(name: str, episodes: list[Episode], success_key: str = "success",
              extra_keys: Iterable[str] = ()) -> EvalSummary:
    n = len(episodes)
    wins = sum(1 for e in episodes if e.trajectory.rewards.get(success_key, 0.0) > 0)
    tokens = [sum(len(t.completion_ids or []) for t in e.trajectory.turns) for e in episodes]
    extra = {k: sum(float(e.info.get(k, 0) or 0) for e in episodes) / max(n, 1) for k in extra_keys}
    return EvalSummary(name, n, wins, sum(e.reward for e in episodes) / max(n, 1),
                       sum(e.steps for e in episodes) / max(n, 1), sum(tokens) / max(n, 1),
                       sum(e.error is not None for e in episodes), extra)


async def aevaluate(client: ModelClient, make_env: EnvFactory, seeds: Iterable[int], *, name: str = "policy",
                    graph: str = "react", params: SamplingParams | None = None, max_steps: int = 8,
                    samples_per_seed: int = 1, extra_keys: Iterable[str] = (),
                    metadata: dict[str, Any] | None = None) -> tuple[EvalSummary, list[Episode]]:
    """Run the graph on every seed (greedy by default) and summarise."""
    policy = GraphPolicy(client, graph, params or SamplingParams(temperature=0.0, max_tokens=64))
    groups = await collect_groups(make_env, policy, list(seeds), samples_per_seed, max_steps=max_steps,
                                  sample_seed=0, metadata={"eval": name, **(metadata or {})})
    episodes = [e for g in groups for e in g.episodes]
    return summarise(name, episodes, extra_keys=extra_keys), episodes


def evaluate(client: ModelClient, make_env: EnvFactory, seeds: Iterable[int], **kwargs: Any
             ) -> tuple[EvalSummary, list[Episode]]:
    return asyncio.run(aevaluate(client, make_env, seeds, **kwargs))


__all__ = ["EvalSummary", "aevaluate", "evaluate", "summarise", "wilson_interval"]
