"""From rollout groups to the tensors GRPO optimises.

Kept apart from the training loop so each step can be checked by hand: rewards per episode
(named components, weighted), per-turn credit (see :mod:`closedloop.trainers.advantages` for the
rule), and the padded batch whose ids are exactly the sampled ids (``Trajectory.token_view``;
nothing is re-tokenised).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from closedloop.messages import Trajectory
from closedloop.trainers.advantages import Scale, token_advantages, turn_level_advantages
from closedloop.trainers.rollout import Group

RewardFn = Callable[[Trajectory], float]


def load_reward_fn(path: str) -> tuple[str, RewardFn]:
    """``"package.module:function"`` → (name, callable). The name is the function's, used to log
    the component apart."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"reward function {path!r} must look like 'package.module:function'")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ValueError(f"{path!r} is not a callable")
    return attr, fn


@dataclass
class RewardSpec:
    """How environment components and reward functions combine.

    ``weights``: component → weight (components not named weigh 1.0). ``turn_components`` are
    credited per turn (their per-turn values feed the turn-level advantage); all others form the
    episode's final reward. ``functions`` are extra named rewards computed on the finished
    trajectory (final-reward side). A turn has no per-turn reward (None) when none of the turn
    components applied to it: absent from its reward dict, or named by the environment as
    inapplicable to every step the turn took (``metadata["inapplicable_rewards"]``, see
    :mod:`closedloop.trainers.rollout`).
    """

    weights: dict[str, float] = field(default_factory=dict)
    turn_components: list[str] = field(default_factory=list)
    functions: dict[str, RewardFn] = field(default_factory=dict)

    def w(self, name: str) -> float:
        return float(self.weights.get(name, 1.0))

    def score(self, traj: Trajectory) -> tuple[float, list[float | None], dict[str, float]]:
        """(final reward, per-turn rewards (None: none applied), every named component unweighted for logging)."""
        comps = dict(traj.rewards)
        for name, fn in self.functions.items():
            comps[name] = float(fn(traj))
        final = sum(self.w(k) * v for k, v in comps.items() if k not in self.turn_components)
        inapplicable = traj.metadata.get("inapplicable_rewards") or []
        per_turn: list[float | None] = []
        for k, tr in enumerate(traj.metadata.get("turn_rewards") or [{} for _ in traj.turns]):
            skip = set(inapplicable[k]) if k < len(inapplicable) else set()
            applied = [c for c in tr if c in self.turn_components and c not in skip]
            per_turn.append(sum(self.w(c) * tr[c] for c in applied) if applied else None)
        if len(per_turn) != len(traj.turns):
            per_turn = (per_turn + [None] * len(traj.turns))[: len(traj.turns)]
        return final, per_turn, comps


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] float: trained tokens
    old_logps: torch.Tensor  # [B, T] recorded sampling logprobs (0 where logprob_mask is 0)
    logprob_mask: torch.Tensor  # [B, T] 1 where old_logps is a recorded value
    advantages: torch.Tensor  # [B, T] per-token advantages (0 on context)
    rows_per_episode: list[int]
    truncated_tokens: int = 0
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def slice(self, idx: slice) -> "RolloutBatch":
        return RolloutBatch(self.input_ids[idx], self.attention_mask[idx], self.loss_mask[idx], self.old_logps[idx],
                            self.logprob_mask[idx], self.advantages[idx], [], 0, {})


def build_batch(groups: list[Group], spec: RewardSpec, *, scale: Scale = "group", gamma: float = 1.0,
                turn_weight: float = 1.0, max_length: int | None = None, pad_id: int = 0,
                turn_baseline: Literal["group", "position"] = "group",
                missing_turn_rewards: Literal["zero", "exclude"] = "zero") -> RolloutBatch:
    """Score every episode, assign per-token advantages, and pad the token views into a batch.

    ``missing_turn_rewards``: what a turn without a per-turn reward (None from
    :meth:`RewardSpec.score`) counts as in the turn-level advantage (``missing`` of
    :func:`~closedloop.trainers.advantages.turn_level_advantages`).

    Episodes whose turns have no token ids (a remote server that does not return them) are
    refused with :class:`~closedloop.messages.MissingTokensError` by ``token_view``.
    """
    finals: list[float] = []
    turn_rewards: list[list[float | None]] = []
    group_ids: list[int] = []
    trajs: list[Trajectory] = []
    comp_sums: dict[str, list[float]] = {}
    for gi, g in enumerate(groups):
        for ep in g.episodes:
            final, per_turn, comps = spec.score(ep.trajectory)
            finals.append(final)
            turn_rewards.append(per_turn)
            group_ids.append(gi)
            trajs.append(ep.trajectory)
            for k, v in comps.items():
                comp_sums.setdefault(k, []).append(v)
    per_turn_adv = turn_level_advantages(torch.tensor(finals, dtype=torch.float32), turn_rewards,
                                         torch.tensor(group_ids), gamma=gamma, turn_weight=turn_weight, scale=scale,
                                         turn_baseline=turn_baseline, missing=missing_turn_rewards)
    ids_rows: list[list[int]] = []
    mask_rows: list[list[int]] = []
    lp_rows: list[list[float]] = []
    lpm_rows: list[list[int]] = []
    turn_rows: list[list[int]] = []
    row_turn_adv: list[list[float]] = []  # per row: its episode's per-turn advantages
    rows_per_episode: list[int] = []
    truncated = 0
    for traj, adv in zip(trajs, per_turn_adv):
        views = traj.token_view()
        rows_per_episode.append(len(views))
        episode_adv = [float(a) for a in adv]
        for view in views:
            n = len(view.input_ids) if max_length is None else min(len(view.input_ids), max_length)
            truncated += len(view.input_ids) - n
            turn_rows.append(list(view.turn_index[:n]))
            row_turn_adv.append(episode_adv)
            ids_rows.append(list(view.input_ids[:n]))
            mask_rows.append(list(view.loss_mask[:n]))
            lp_rows.append(list(view.logprobs[:n]))
            lpm_rows.append(list(view.logprob_mask[:n]))
    width = max((len(r) for r in ids_rows), default=1)

    def padded(rows: list[list[Any]], value: Any, dtype: torch.dtype) -> torch.Tensor:
        # right padding (training needs no KV cache alignment); one tensor per field, not per row
        if not rows:
            return torch.full((0, width), value, dtype=dtype)
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)

    ids = padded(ids_rows, pad_id, torch.long)
    attn = padded([[1] * len(r) for r in ids_rows], 0, torch.long)
    mask = padded(mask_rows, 0.0, torch.float32)
    old = padded(lp_rows, 0.0, torch.float32)
    lpm = padded(lpm_rows, 0.0, torch.float32)
    advs = token_advantages(row_turn_adv, padded(turn_rows, -1, torch.long)) if ids_rows else mask.clone()
    stats: dict[str, float] = {"reward": float(sum(finals) / max(len(finals), 1))}
    for k, vs in comp_sums.items():
        stats[f"rewards/{k}"] = sum(vs) / len(vs)
    stats["episodes"] = float(len(trajs))
    return RolloutBatch(ids, attn, mask, old, lpm, advs,
                        rows_per_episode, truncated, stats)


__all__ = ["RewardFn", "RewardSpec", "RolloutBatch", "build_batch", "load_reward_fn"]
