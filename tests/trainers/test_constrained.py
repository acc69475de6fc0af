"""Constrained GRPO: the dual update, the penalty in the advantages, costs, config and resume state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from closedloop.messages import AssistantMessage, ToolCall, ToolMessage, Trajectory, Turn, UserMessage
from closedloop.trainers.advantages import group_advantages
from closedloop.trainers.constrained import ConstraintSet, CostConstraint, LagrangeMultiplier, episode_cost
from closedloop.trainers.grpo_batch import RewardSpec


def test_multiplier_rises_while_violated_and_falls_to_zero_when_satisfied():
    lam = LagrangeMultiplier(CostConstraint(cost="turns", budget=2.0, multiplier_lr=0.5))
    assert lam.value == 0.0
    rising = [lam.update(3.0) for _ in range(4)]  # violated by 1: +0.5 per step
    assert rising == [0.5, 1.0, 1.5, 2.0]
    assert lam.update(2.0) == 2.0  # exactly on budget: unchanged
    falling = [lam.update(1.0) for _ in range(6)]  # slack by 1: −0.5 per step, projected at 0
    assert falling == [1.5, 1.0, 0.5, 0.0, 0.0, 0.0]
    capped = LagrangeMultiplier(CostConstraint(cost="turns", budget=0.0, multiplier_lr=10.0, multiplier_max=3.0))
    assert capped.update(5.0) == 3.0


def _episode(reward: float, turns: int, tool_calls: int = 0, info=None):
    msgs = [UserMessage(content="q")]
    turn_list = []
    for i in range(turns):
        calls = [ToolCall.make("add", {"a": 1, "b": 2}, id=f"c{i}")] if i < tool_calls else []
        msgs.append(AssistantMessage(content="" if calls else "3", tool_calls=calls or None))
        if calls:
            msgs.append(ToolMessage(content="3", tool_call_id=f"c{i}", name="add"))
        turn_list.append(Turn(message=msgs[-2] if calls else msgs[-1], prompt_ids=[1], completion_ids=[2, 3, 4]))
    traj = Trajectory(messages=msgs, turns=turn_list, rewards={"success": reward})
    return SimpleNamespace(trajectory=traj, info=info or {})


def test_penalty_enters_the_advantages():
    """Same task reward, different turns: λ = 0 gives equal advantages, λ > 0 a negative one to the
    longer episode (R − λ·C through group normalisation)."""
    cs = ConstraintSet([CostConstraint(cost="turns", budget=1.5)])
    eps = [_episode(1.0, 1), _episode(1.0, 3), _episode(0.0, 1), _episode(0.0, 3)]
    costs = cs.annotate(eps)
    assert [c["turns"] for c in costs] == [1.0, 3.0, 1.0, 3.0]

    def advantages():
        spec = cs.reward_spec(RewardSpec())
        finals = [spec.score(e.trajectory)[0] for e in eps]
        return finals, group_advantages(finals, group_ids=[0, 0, 1, 1])

    finals, adv = advantages()
    assert finals == [1.0, 1.0, 0.0, 0.0] and torch.equal(adv, torch.zeros(4))
    metrics = cs.step(costs, {"reward": sum(finals) / 4})
    assert metrics["constraint/turns/lambda"] == 0.0 and metrics["constraint/turns/cost"] == 2.0
    assert metrics["constraint/turns/violation"] == 0.5 and cs.lambdas["turns"] == 0.25
    finals, adv = advantages()
    assert finals == pytest.approx([0.75, 0.25, -0.25, -0.75])
    assert adv[0] > 0 > adv[1] and adv[2] > 0 > adv[3]
    metrics = cs.step(costs, {"reward": sum(finals) / 4})
    assert metrics["reward"] == pytest.approx(0.5) and metrics["reward_penalized"] == pytest.approx(0.0)


def test_cost_sources():
    ep = _episode(1.0, 3, tool_calls=2, info={"lag": 4})
    traj = ep.trajectory
    traj.rewards["lag_penalty"] = -2.5
    assert episode_cost(CostConstraint(cost="turns", budget=1), traj) == 3.0
    assert episode_cost(CostConstraint(cost="tool_calls", budget=1), traj) == 2.0
    assert episode_cost(CostConstraint(cost="completion_tokens", budget=1), traj) == 9.0
    assert episode_cost(CostConstraint(cost="component:lag_penalty", budget=1, negate=True), traj) == 2.5
    assert episode_cost(CostConstraint(cost="info:lag", budget=1), traj, ep.info) == 4.0
    assert episode_cost(CostConstraint(cost="closedloop.trainers.rewards:num_turns", budget=1), traj) == 3.0
    with pytest.raises(ValueError, match="no number under 'nope'"):
        episode_cost(CostConstraint(cost="info:nope", budget=1), traj, ep.info)
    with pytest.raises(ValidationError, match="component:NAME"):
        CostConstraint(cost="steps", budget=1)
    with pytest.raises(ValueError, match="unique"):
        ConstraintSet([CostConstraint(cost="turns", budget=1), CostConstraint(cost="turns", budget=2)])


def test_grpo_config_takes_constraints_and_state_survives_resume(tmp_path):
    from closedloop.trainers.config import load_config
    from closedloop.trainers.grpo import GRPOConfig

    cfg = load_config(GRPOConfig, None, [f"model={tmp_path}", "output_dir=o",
                                         "constraints=[{cost: turns, budget: 2.0, multiplier_lr: 0.2}]"])
    (c,) = cfg.constraints
    assert (c.cost, c.budget, c.multiplier_lr, c.key) == ("turns", 2.0, 0.2, "turns")
    cs = ConstraintSet(cfg.constraints)
    cs.multipliers["turns"].value = 1.25
    cs.save(tmp_path, 7)
    again = ConstraintSet(cfg.constraints)
    assert not again.load(tmp_path, 6) and again.lambdas["turns"] == 0.0  # another step's state is not used
    assert again.load(tmp_path, 7) and again.lambdas["turns"] == 1.25
