"""Advantages: GRPO's group normalisation equals TRL's (its own source run as the oracle), and
turn-level credit lands where a hand computation on a three-turn toy says it must."""

from __future__ import annotations

import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch

from closedloop.messages import AssistantMessage, Trajectory, Turn
from closedloop.trainers.advantages import (discounted_returns, group_advantages, token_advantages,
                                            turn_level_advantages)

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402


def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """Run the advantage block of TRL's ``_generate_and_score_completions`` (installed version) on ``rewards``."""
    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    start = 'if self.multi_objective_aggregation == "sum_then_normalize"'
    i = next(n for n, line in enumerate(lines) if line.strip().startswith(start))
    j = next(n for n in range(i, len(lines)) if lines[n].strip().startswith("# Unscorable completions"))
    rewards_per_func = rewards.float().unsqueeze(1)
    scope = {"self": SimpleNamespace(multi_objective_aggregation="sum_then_normalize", reward_weights=torch.ones(1),
                                     scale_rewards=scale_rewards, reward_funcs=[None]),
             "rewards_per_func": rewards_per_func, "unscorable_mask": torch.isnan(rewards_per_func).all(dim=1),
             "num_generations": num_generations, "device": "cpu", "nanstd": nanstd, "torch": torch}
    exec(textwrap.dedent("\n".join(lines[i:j])), scope)
    return torch.nan_to_num(scope["advantages"], nan=0.0)


REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0,   # a mixed group
                        2.0, 2.0, 2.0, 2.0,   # zero std: advantages 0
                        0.3, float("nan"), 1.7, -1.0])  # one unscorable completion


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale):
    theirs = trl_advantages(REWARDS, 4, scale)
    ours = group_advantages(REWARDS, group_size=4, scale=scale)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert ours[4:8].abs().max() == 0 and ours[9] == 0
    # the same groups named by ids, interleaved, give the same advantages
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    ids = [f"task{k // 4}" for k in order.tolist()]
    torch.testing.assert_close(group_advantages(REWARDS[order], ids, scale=scale), ours[order])


def test_group_advantages_hand_values():
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> ±0.5 / (0.7071 + 1e-4)
    a = group_advantages([1.0, 0.0], group_size=2)
    assert a.tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)], rel=1e-6)
    assert group_advantages([1.0, 0.0], group_size=2, scale="none").tolist() == [0.5, -0.5]


def test_group_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="exactly one"):
        group_advantages([1.0, 2.0])
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1.0, 2.0], group_size=3)
    with pytest.raises(ValueError, match="scale"):
        group_advantages([1.0, 2.0], group_size=2, scale="std")
    with pytest.raises(ValueError, match="group_ids has 1"):
        group_advantages([1.0, 2.0], ["a"])


# ------------------------------------------------------------------------------------- turn-level credit


def test_discounted_returns():
    assert discounted_returns([0, 0, 4], gamma=0.5) == [1.0, 2.0, 4.0]
    assert discounted_returns([1, None, 2], gamma=1.0) == [3.0, 2.0, 2.0]


def test_three_turn_toy_credit_by_hand():
    """Two episodes of one group, three turns each, γ = 0.5, scale "none" (no std division):

    episode 0 (succeeds, R=1): turn rewards r = [0, 0, 4]  -> G = [0 + .5·0 + .25·4, 0 + .5·4, 4] = [1, 2, 4]
    episode 1 (fails,    R=0): turn rewards r = [1, 0, 0]  -> G = [1, 0, 0]
    mean of the six G = 8/6 = 4/3 -> A^turn: ep0 [-1/3, 2/3, 8/3], ep1 [-1/3, -4/3, -4/3]
    A^final = R - mean(R) = [+1/2, -1/2]
    A = A^final + 1·A^turn: ep0 [1/6, 7/6, 19/6], ep1 [-5/6, -11/6, -11/6]
    So the turn that earned the big reward (ep0, turn 2) gets the most credit; in the failed episode the
    first turn, which earned a reward, is blamed less than the two after it.
    """
    adv = turn_level_advantages([1.0, 0.0], [[0, 0, 4], [1, 0, 0]], group_size=2, gamma=0.5, scale="none")
    assert adv[0] == pytest.approx([1 / 6, 7 / 6, 19 / 6])
    assert adv[1] == pytest.approx([-5 / 6, -11 / 6, -11 / 6])
    # turn_weight scales only the turn part: A = A^final + 0.5·A^turn
    half = turn_level_advantages([1.0, 0.0], [[0, 0, 4], [1, 0, 0]], group_size=2, gamma=0.5, scale="none",
                                 turn_weight=0.5)
    assert half[0] == pytest.approx([0.5 - 1 / 6, 0.5 + 1 / 3, 0.5 + 4 / 3])

    # scale "group": both parts divided by their group's unbiased std (+1e-4)
    g = [1, 2, 4, 1, 0, 0]
    mean = sum(g) / 6
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 5)
    final = 0.5 / (math.sqrt(0.5) + 1e-4)
    scaled = turn_level_advantages([1.0, 0.0], [[0, 0, 4], [1, 0, 0]], group_size=2, gamma=0.5)
    assert scaled[0] == pytest.approx([final + (x - mean) / (std + 1e-4) for x in g[:3]], rel=1e-6)
    assert scaled[1] == pytest.approx([-final + (x - mean) / (std + 1e-4) for x in g[3:]], rel=1e-6)


def _three_turn_trajectory(prefix: int) -> Trajectory:
    """user prompt, then three assistant turns separated by tool results (context tokens)."""
    p0 = [1, prefix, 2]
    c0 = [10, 11]
    p1 = p0 + c0 + [5, 6]
    c1 = [12]
    p2 = p1 + c1 + [7]
    c2 = [13, 14, 3]
    return Trajectory(turns=[Turn(message=AssistantMessage(content=str(k)), prompt_ids=p, completion_ids=c)
                             for k, (p, c) in enumerate([(p0, c0), (p1, c1), (p2, c2)])])


def test_three_turn_toy_credit_lands_on_its_own_tokens_and_never_on_context():
    views = [_three_turn_trajectory(40 + i).token_view()[0] for i in range(2)]
    turn_index = torch.tensor([v.turn_index for v in views])
    assert turn_index[0].tolist() == [-1, -1, -1, 0, 0, -1, -1, 1, -1, 2, 2, 2]
    per_turn = turn_level_advantages([1.0, 0.0], [[0, 0, 4], [1, 0, 0]], group_size=2, gamma=0.5, scale="none")
    tok = token_advantages(per_turn, turn_index)
    assert tok[0].tolist() == pytest.approx([0, 0, 0, 1 / 6, 1 / 6, 0, 0, 7 / 6, 0, 19 / 6, 19 / 6, 19 / 6])
    assert tok[1].tolist() == pytest.approx([0, 0, 0, -5 / 6, -5 / 6, 0, 0, -11 / 6, 0, -11 / 6, -11 / 6, -11 / 6])
    context = turn_index == -1
    assert tok[context].abs().max() == 0
    assert torch.equal(torch.tensor([v.loss_mask for v in views]) == 0, context)


def test_without_turn_rewards_it_is_exactly_grpo():
    final = torch.tensor([1.0, 0.0, 0.25, 0.0, 3.0, 1.0])
    for scale in ("group", "batch", "none"):
        seq = group_advantages(final, group_size=3, scale=scale)
        per_turn = turn_level_advantages(final, [[]] * 6, group_size=3, scale=scale, num_turns=[3, 1, 2, 3, 3, 1])
        assert [len(a) for a in per_turn] == [3, 1, 2, 3, 3, 1]
        for i, a in enumerate(per_turn):
            assert a == [seq[i].item()] * len(a)
        zeros = turn_level_advantages(final, [[0.0, None]] * 6, group_size=3, scale=scale, gamma=0.9)
        assert [a[0] for a in zeros] == seq.tolist()


def test_turn_credit_errors_are_clear():
    with pytest.raises(ValueError, match="2 turn-reward lists for 3 episodes"):
        turn_level_advantages([1.0, 0.0, 1.0], [[1.0], [0.0]], group_size=3)
    with pytest.raises(ValueError, match="num_turns=1"):
        turn_level_advantages([1.0, 0.0], [[1.0, 2.0], [0.0]], group_size=2, num_turns=[1, 1])
    with pytest.raises(ValueError, match="no advantage"):
        token_advantages([[0.5], [0.1]], torch.tensor([[-1, 0, 1], [-1, 0, 0]]))
    with pytest.raises(ValueError, match="len\\(per_turn\\)"):
        token_advantages([[0.5]], torch.tensor([[-1, 0], [0, 0]]))


def test_position_baseline_compares_each_turn_with_the_same_numbered_turns():
    # Two episodes of one group: ask (IG 1), ask (IG 1), answer (0) vs ask (1), ask again (0), answer (0).
    # Pooled over the group's turns, both final answers are pushed down (their return is below the
    # pool's mean); per position, the final answers tie (0 advantage) and only turn 1 differs.
    final = [0.0, 0.0]
    rewards = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    pooled = turn_level_advantages(final, rewards, group_size=2, gamma=0.0, scale="none")
    assert pooled[0][2] == pytest.approx(-0.5) and pooled[1][2] == pytest.approx(-0.5)
    per_pos = turn_level_advantages(final, rewards, group_size=2, gamma=0.0, scale="none", turn_baseline="position")
    assert per_pos == [pytest.approx([0.0, 0.5, 0.0]), pytest.approx([0.0, -0.5, 0.0])]
    # episodes of different lengths: a turn index only one episode reached gets no turn credit
    ragged = turn_level_advantages([0.0, 0.0], [[1.0, 0.0, 1.0], [1.0]], group_size=2, gamma=0.0, scale="group",
                                   turn_baseline="position")
    assert ragged[0][1:] == [0.0, 0.0] and ragged[0][0] == ragged[1][0] == 0.0
    with pytest.raises(ValueError, match="turn_baseline"):
        turn_level_advantages(final, rewards, group_size=2, turn_baseline="episode")


def test_missing_turn_rewards_excluded_compare_questions_only_with_questions():
    # One group of two episodes, γ = 0, no scaling, so every number is a hand computation.
    # Episode 0: ask (gain 1), ask (gain 1), submit (no gain at all: None), success R = 1.
    # Episode 1: ask (1), repeat (0), ask (1), truncated, R = 0.   A^final = +0.5, −0.5.
    final = [1.0, 0.0]
    rewards = [[1.0, 1.0, None], [1.0, 0.0, 1.0]]
    # "zero" (default): the submit's 0 joins the pool (mean 4/6) and the successful submit is pushed
    # below its episode's final advantage: 0.5 − 2/3 < 0.
    zero = turn_level_advantages(final, rewards, group_size=2, gamma=0.0, scale="none")
    assert zero[0] == pytest.approx([0.5 + 1 / 3, 0.5 + 1 / 3, 0.5 - 2 / 3])
    assert zero == turn_level_advantages(final, [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]], group_size=2, gamma=0.0,
                                         scale="none")  # None = 0: the default is unchanged
    # "exclude": the pool is the five questions (mean 4/5); the submit keeps exactly A^final.
    ex = turn_level_advantages(final, rewards, group_size=2, gamma=0.0, scale="none", missing="exclude")
    assert ex == [pytest.approx([0.7, 0.7, 0.5]), pytest.approx([-0.3, -1.3, -0.3])]
    # per position: at turn 2 the submit is no longer compared with episode 1's question
    pos_zero = turn_level_advantages(final, rewards, group_size=2, gamma=0.0, scale="none", turn_baseline="position")
    assert pos_zero[0][2] == pytest.approx(0.0) and pos_zero[1][2] == pytest.approx(0.0)  # 0.5 − 0.5, −0.5 + 0.5
    pos_ex = turn_level_advantages(final, rewards, group_size=2, gamma=0.0, scale="none", turn_baseline="position",
                                   missing="exclude")
    assert pos_ex == [pytest.approx([0.5, 1.0, 0.5]), pytest.approx([-0.5, -1.0, -0.5])]
    # with std scaling, an excluded turn is outside the std too: the same as not having the turn
    scaled = turn_level_advantages(final, rewards, group_size=2, gamma=0.0, missing="exclude")
    short = turn_level_advantages(final, [[1.0, 1.0], [1.0, 0.0, 1.0]], group_size=2, gamma=0.0)
    a_final = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert scaled[0][:2] == pytest.approx(short[0]) and scaled[1] == pytest.approx(short[1])
    assert scaled[0][2] == pytest.approx(a_final)
    std = math.sqrt((4 * 0.2 ** 2 + 0.8 ** 2) / 4)
    assert scaled[1][1] == pytest.approx(-a_final - 0.8 / (std + 1e-4))
    # num_turns pads with missing rewards; without any None the two rules agree
    padded = turn_level_advantages(final, [[1.0, 1.0], [1.0, 0.0, 1.0]], group_size=2, gamma=0.0, scale="none",
                                   num_turns=[3, 3], missing="exclude")
    assert padded == ex
    plain = [[1.0, 0.5, 0.0], [0.0, 2.0]]
    assert turn_level_advantages(final, plain, group_size=2, gamma=0.7, missing="exclude") == \
        turn_level_advantages(final, plain, group_size=2, gamma=0.7)
    with pytest.raises(ValueError, match="missing"):
        turn_level_advantages(final, rewards, group_size=2, missing="skip")


def test_reward_spec_gives_a_turn_without_an_applicable_turn_component_no_reward():
    from closedloop.trainers.grpo_batch import RewardSpec

    traj = _three_turn_trajectory(40)
    traj.rewards = {"success": 1.0, "info_gain": 2.0, "turn_cost": -0.15}
    traj.metadata = {"turn_rewards": [{"info_gain": 1.0, "turn_cost": -0.05}, {"info_gain": 0.0, "turn_cost": -0.05},
                                      {"info_gain": 0.0, "success": 1.0, "turn_cost": -0.05}],
                     "inapplicable_rewards": [[], [], ["info_gain"]]}
    spec = RewardSpec(weights={"info_gain": 0.5}, turn_components=["info_gain"])
    final, per_turn, comps = spec.score(traj)
    assert final == pytest.approx(0.85) and per_turn == [0.5, 0.0, None] and comps == traj.rewards
    traj.metadata.pop("inapplicable_rewards")  # an environment that does not say: the submit's 0.0 is a reward
    assert spec.score(traj)[1] == [0.5, 0.0, 0.0]
    assert RewardSpec().score(traj)[1] == [None, None, None]  # no turn components: nothing per turn
