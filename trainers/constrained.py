"""Constrained GRPO: cost budgets enforced by Lagrange multipliers updated by dual ascent.

The problem is ``max_θ E[R]`` subject to ``E[C_k] ≤ b_k`` for each constraint k (expected turns,
tool calls, completion tokens, lag, any reward component or environment info field). Its
Lagrangian relaxation ``max_θ min_{λ≥0} E[R − Σ_k λ_k (C_k − b_k)]`` is solved by alternating:

1. primal (one GRPO step): each episode's final reward becomes ``R − Σ_k λ_k C_k``, so the penalty
   flows through group normalisation into every token's advantage (the constant ``λ_k b_k`` would
   cancel in the group mean and is left out);
2. dual (projected gradient ascent on λ, after the step's rollouts are scored):
   ``λ_k ← clip(λ_k + η_k (Ĉ_k − b_k), 0, λ_max)`` with ``Ĉ_k`` the step's mean cost over every
   episode of every process (all-reduced, so ranks keep one λ).

λ rises while the budget is violated and decays back (to 0 if the constraint stays slack), so the
policy pays for cost only as much as the budget requires: the smallest loss of reward that meets
it (at a fixed point Ĉ_k = b_k or λ_k = 0). Logged per step: ``constraint/<name>/cost``,
``/lambda`` (the value used in this step), ``/violation`` (Ĉ − b), plus ``reward`` (task reward,
penalty excluded, comparable with an unconstrained run) and ``reward_penalized`` (what the
advantages saw). Each episode's costs are kept in ``trajectory.metadata["costs"]`` (and so in the
store).

Interaction with group normalisation: with ``scale_rewards: group`` the advantages are scale-free
within a group, so λ's size matters only against the task reward's own variance there; in a group
whose task rewards are all equal, any λ > 0 ranks the episodes by cost at full strength, and a
group whose costs are all equal gets no push at all (the penalty cancels in the mean). With
``scale_rewards: none`` the penalty's magnitude counts directly. TRL has no equivalent (its constrained-optimisation request has been open since 2024).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from closedloop.messages import AssistantMessage, Trajectory

__all__ = ["CostConstraint", "LagrangeMultiplier", "ConstraintSet", "episode_cost", "BUILTIN_COSTS"]


def _turns(traj: Trajectory) -> float:
    return float(sum(1 for t in traj.turns if t.trainable))


def _tool_calls(traj: Trajectory) -> float:
    return float(sum(len(m.tool_calls or []) for m in traj.messages if isinstance(m, AssistantMessage)))


def _completion_tokens(traj: Trajectory) -> float:
    return float(sum(len(t.completion_ids or []) for t in traj.turns if t.trainable))


def _latency_s(traj: Trajectory) -> float:
    return float(sum(t.latency_s or 0.0 for t in traj.turns if t.trainable))


BUILTIN_COSTS: dict[str, Callable[[Trajectory], float]] = {
    "turns": _turns, "tool_calls": _tool_calls, "completion_tokens": _completion_tokens, "latency_s": _latency_s}


class CostConstraint(BaseModel):
    """``E[cost] ≤ budget`` per episode, enforced through a multiplier λ ≥ 0 (dual ascent)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    cost: str = Field(..., description="What an episode costs: turns (policy turns), tool_calls (calls the policy "
                                       "made), completion_tokens, latency_s; component:NAME (an environment reward "
                                       "component, e.g. a lag); info:KEY (a number in the episode's last step info); "
                                       "or 'package.module:function' of the finished Trajectory.")
    budget: float = Field(..., description="The bound on the expected cost per episode.")
    name: str | None = Field(None, description="Name in metrics and metadata (default: from `cost`).")
    negate: bool = Field(False, description="Use −value as the cost (for components given as negative rewards).")
    multiplier_lr: float = Field(0.5, gt=0, description="Dual step size η: λ moves by η·(mean cost − budget) per step.")
    multiplier_init: float = Field(0.0, ge=0, description="λ at the first step.")
    multiplier_max: float | None = Field(100.0, ge=0, description="Upper clip of λ (null: none); bounds the penalty "
                                                                   "while the policy cannot yet meet the budget. 0 "
                                                                   "only monitors the cost (logged, never penalised).")

    @field_validator("cost")
    @classmethod
    def _cost_spec(cls, value: str) -> str:
        head, sep, rest = value.partition(":")
        if value in BUILTIN_COSTS or (sep and head.strip() and rest.strip()):
            return value  # component:NAME, info:KEY, or package.module:function (resolved when the set is built)
        raise ValueError(f"cost {value!r}: use one of {sorted(BUILTIN_COSTS)}, component:NAME, info:KEY or "
                         "'package.module:function'")

    @property
    def key(self) -> str:
        return self.name or self.cost.replace(":", "_")


def episode_cost(constraint: CostConstraint, trajectory: Trajectory, info: dict[str, Any] | None = None,
                 fn: Callable[[Trajectory], float] | None = None) -> float:
    """One episode's cost under ``constraint`` (``info``: the episode's last step info)."""
    spec = constraint.cost
    if spec in BUILTIN_COSTS:
        value = BUILTIN_COSTS[spec](trajectory)
    elif spec.startswith("component:"):
        value = float(trajectory.rewards.get(spec[len("component:"):], 0.0))
    elif spec.startswith("info:"):
        key = spec[len("info:"):]
        raw = (info or {}).get(key)
        if not isinstance(raw, (int, float)):
            raise ValueError(f"constraint {constraint.key}: the episode's info has no number under {key!r} "
                             f"(keys: {sorted(info or {})})")
        value = float(raw)
    else:
        if fn is None:
            from closedloop.trainers.grpo_batch import load_reward_fn

            fn = load_reward_fn(spec)[1]
        value = float(fn(trajectory))
    return -value if constraint.negate else value


class LagrangeMultiplier:
    """λ ≥ 0 for one constraint, updated by projected dual ascent (module docstring)."""

    def __init__(self, constraint: CostConstraint) -> None:
        self.constraint = constraint
        self.value = float(constraint.multiplier_init)

    def update(self, mean_cost: float) -> float:
        """``λ ← clip(λ + η (mean_cost − budget), 0, λ_max)``; returns the new λ."""
        c = self.constraint
        value = max(0.0, self.value + c.multiplier_lr * (float(mean_cost) - c.budget))
        self.value = min(value, c.multiplier_max) if c.multiplier_max is not None else value
        return self.value


class ConstraintSet:
    """The constraints of one GRPO run: costs per episode, the penalised reward spec, dual updates."""

    def __init__(self, constraints: Iterable[CostConstraint]) -> None:
        self.constraints = list(constraints)
        keys = [c.key for c in self.constraints]
        if len(set(keys)) != len(keys):
            raise ValueError(f"constraint names must be unique, got {keys}")
        self.multipliers = {c.key: LagrangeMultiplier(c) for c in self.constraints}
        self._fns: dict[str, Callable[[Trajectory], float]] = {}
        for c in self.constraints:
            if c.cost not in BUILTIN_COSTS and not c.cost.startswith(("component:", "info:")):
                from closedloop.trainers.grpo_batch import load_reward_fn

                self._fns[c.key] = load_reward_fn(c.cost)[1]

    def __bool__(self) -> bool:
        return bool(self.constraints)

    @property
    def lambdas(self) -> dict[str, float]:
        return {k: m.value for k, m in self.multipliers.items()}

    def annotate(self, episodes: Iterable[Any]) -> list[dict[str, float]]:
        """Costs of each episode (``Episode`` with ``trajectory`` and ``info``), also written to
        ``trajectory.metadata["costs"]``."""
        out = []
        for ep in episodes:
            costs = {c.key: episode_cost(c, ep.trajectory, getattr(ep, "info", None), self._fns.get(c.key))
                     for c in self.constraints}
            ep.trajectory.metadata["costs"] = costs
            out.append(costs)
        return out

    def reward_spec(self, spec: Any) -> Any:
        """``spec`` (a :class:`~closedloop.trainers.grpo_batch.RewardSpec`) plus one function per
        constraint returning the episode's cost, weighted −λ: the final reward becomes R − Σ λ_k C_k."""
        functions = dict(spec.functions)
        weights = dict(spec.weights)
        for c in self.constraints:
            name = f"cost/{c.key}"
            functions[name] = (lambda traj, k=c.key: float(traj.metadata["costs"][k]))
            weights[name] = -self.multipliers[c.key].value
        return replace(spec, functions=functions, weights=weights)

    def step(self, costs: list[dict[str, float]], stats: dict[str, float],
             reduce: Callable[[list[float]], list[float]] | None = None) -> dict[str, float]:
        """Dual ascent after a step's rollouts: metrics (with the λ used in this step) and the
        task reward ``reward`` (``stats["reward"]`` plus the penalty back) / ``reward_penalized``.
        ``reduce`` sums ``[cost sums..., count]`` over processes (DDP)."""
        totals = [sum(c[k.key] for c in costs) for k in self.constraints] + [float(len(costs))]
        if reduce is not None:
            totals = reduce(totals)
        n = max(totals[-1], 1.0)
        metrics: dict[str, float] = {}
        penalty = 0.0
        local_n = max(len(costs), 1)
        for c, total in zip(self.constraints, totals):
            mean = total / n
            used = self.multipliers[c.key].value
            penalty += used * sum(x[c.key] for x in costs) / local_n
            metrics[f"constraint/{c.key}/cost"] = mean
            metrics[f"constraint/{c.key}/lambda"] = used
            metrics[f"constraint/{c.key}/violation"] = mean - c.budget
            self.multipliers[c.key].update(mean)
        if "reward" in stats:
            metrics["reward_penalized"] = stats["reward"]
            metrics["reward"] = stats["reward"] + penalty
        return metrics

    # ------------------------------------------------------------------ resume

    def save(self, output_dir: str | os.PathLike[str], step: int) -> None:
        path = Path(output_dir) / "constraints_state.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"step": step, "lambdas": self.lambdas}))
        os.replace(tmp, path)

    def load(self, output_dir: str | os.PathLike[str], step: int) -> bool:
        """Restore λ saved at ``step`` (a resumed run); False when there is no such state."""
        path = Path(output_dir) / "constraints_state.json"
        if not path.is_file():
            return False
        state = json.loads(path.read_text())
        if state.get("step") != step:
            return False
        for k, v in state.get("lambdas", {}).items():
            if k in self.multipliers:
                self.multipliers[k].value = float(v)
        return True
