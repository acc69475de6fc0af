"""pass^k against the formula on hand-made trial tables."""

from __future__ import annotations

from math import comb

import pytest

from closedloop.evals.tau.conventions import Conventions
from closedloop.evals.tau.metrics import Trial, compute_metrics, pass_hat_k
from closedloop.evals.tau.simulation import TerminationReason


def trials(table: dict[str, list[float | None]]) -> list[Trial]:
    return [Trial(task_id=t, reward=r, simulation_id=f"{t}-{i}") for t, rs in table.items() for i, r in enumerate(rs)]


def test_pass_hat_k_formula():
    assert pass_hat_k(3, 4, 2) == comb(3, 2) / comb(4, 2) == 0.5
    assert pass_hat_k(4, 4, 4) == 1.0 and pass_hat_k(3, 4, 4) == 0.0
    with pytest.raises(ValueError, match="needs at least 3 trials"):
        pass_hat_k(1, 2, 3)
    with pytest.raises(ValueError):
        pass_hat_k(5, 4, 1)


def test_metrics_over_a_table():
    table = {"a": [1.0, 1.0, 0.0, 1.0], "b": [0.0, 1.0, 0.0, 0.0], "c": [1.0, 1.0, 1.0, 1.0 - 1e-9]}
    m = compute_metrics(trials(table))
    for k in (1, 2, 3, 4):
        want = (comb(3, k) / comb(4, k) + comb(1, k) / comb(4, k) + comb(4, k) / comb(4, k)) / 3
        assert m.pass_hat_k[k] == pytest.approx(want)
        assert m.num_tasks[k] == 3 and m.insufficient[k] == []
    assert m.pass_hat_k[1] == pytest.approx(8 / 12)
    assert m.avg_reward == pytest.approx((3 + 1 + 4 - 1e-9) / 12)


def test_fewer_trials_than_k_and_exclusions_by_tau2s_conventions():
    table = {"a": [1.0, 1.0, 1.0], "b": [1.0, 0.0], "c": [1.0, None, 1.0]}  # None: not graded
    ts = trials(table) + [Trial(task_id="b", reward=None, termination_reason=TerminationReason.INFRASTRUCTURE_ERROR,
                                simulation_id="b-infra")]
    m = compute_metrics(ts, ks=[1, 2, 3])
    assert m.infrastructure_errors == ["b-infra"] and m.ungraded == ["c-1"]
    assert m.num_trials == 8 and m.num_graded == 7
    assert m.avg_reward == pytest.approx(6 / 7)  # the ungraded episode has no reward to average
    # the ungraded trial is a failure: c succeeds 2 of 3
    assert m.pass_hat_k[1] == pytest.approx((1 + 0.5 + 2 / 3) / 3)
    assert m.pass_hat_k[2] == pytest.approx((1 + 0 + 1 / 3) / 3)
    # b has 2 trials, so k stops at 2 for every task; pass^3 is not computed and b is named
    assert 3 not in m.pass_hat_k and m.num_tasks[3] == 0 and m.insufficient[3] == ["b"]
    assert m.num_tasks[2] == 3 and m.insufficient[2] == []
    assert compute_metrics([], ks=[1]).pass_hat_k == {}


def test_our_conventions_exclude_ungraded_and_compute_each_k_per_task():
    table = {"a": [1.0, 1.0, 1.0], "b": [1.0, 0.0], "c": [1.0, None, 1.0]}
    ours = Conventions(ungraded="exclude", pass_k="per-task")
    m = compute_metrics(trials(table), ks=[1, 2, 3], conventions=ours)
    assert m.conventions == ours and m.num_trials == 7 and m.ungraded == ["c-1"]
    assert m.pass_hat_k[1] == pytest.approx((1 + 0.5 + 1) / 3)
    assert m.pass_hat_k[2] == pytest.approx((1 + 0 + 1) / 3)
    # a has 3 trials, b and c only 2 usable: pass^3 covers task a alone, and says so
    assert m.pass_hat_k[3] == 1.0 and m.num_tasks[3] == 1 and m.insufficient[3] == ["b", "c"]
    # each convention alone
    excluded = compute_metrics(trials(table), ks=[1, 2, 3], conventions=Conventions(ungraded="exclude"))
    assert 3 not in excluded.pass_hat_k and excluded.insufficient[3] == ["b", "c"]
    per_task = compute_metrics(trials(table), ks=[1, 2, 3], conventions=Conventions(pass_k="per-task"))
    assert per_task.pass_hat_k[3] == pytest.approx((1 + 0) / 2) and per_task.insufficient[3] == ["b"]
    assert Conventions().not_tau2() == {} and ours.not_tau2() == {"ungraded": "exclude", "pass_k": "per-task"}
