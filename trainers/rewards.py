"""Named reward functions of a finished trajectory, for ``GRPOConfig.reward_funcs``
(``"closedloop.trainers.rewards:latency_s"``). Each is logged apart under its name and weighted by
``reward_weights[name]`` (so a cost takes a negative weight). Environment rewards (success,
format, information gain) come from the environment itself; these are the ones any environment
can add.
"""

from __future__ import annotations

from closedloop.messages import Trajectory


def latency_s(trajectory: Trajectory) -> float:
    """Wall-clock seconds the policy spent generating (sum of turn latencies): weight it
    negatively to train for faster agents (the latency reward of the orchestration papers)."""
    return float(sum(t.latency_s or 0.0 for t in trajectory.turns if t.trainable))


def completion_tokens(trajectory: Trajectory) -> float:
    """Tokens the policy generated over the episode; a negative weight penalises verbosity."""
    return float(sum(len(t.completion_ids or []) for t in trajectory.turns if t.trainable))


def num_turns(trajectory: Trajectory) -> float:
    """Policy turns taken; a negative weight rewards shorter episodes."""
    return float(sum(1 for t in trajectory.turns if t.trainable))


__all__ = ["completion_tokens", "latency_s", "num_turns"]
