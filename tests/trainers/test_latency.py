"""The latency experiment's analytic baselines on the evaluation sentences (the GRPO run itself is
an experiment: ``python -m closedloop.trainers.latency``)."""

from __future__ import annotations

import pytest

from closedloop.trainers.latency import LatencyConfig, baselines


def test_baselines_trade_quality_for_lag():
    b = baselines(LatencyConfig(model="unused", level=2, eval_episodes=30))
    for k in (1, 2, 3):
        assert b[f"wait-{k}"]["al"] == pytest.approx(k)  # AL of wait-k on equal lengths is k
    assert b["wait-1"]["bleu"] < 100 and b["wait-2"]["bleu"] == pytest.approx(100)  # the verb comes third
    assert b["delayed"]["bleu"] == pytest.approx(100) and b["delayed"]["al"] == pytest.approx(4)
    assert b["oracle"]["bleu"] == pytest.approx(100) and b["oracle"]["dal"] < b["wait-2"]["dal"]
    assert b["oracle"]["reward"] == max(v["reward"] for v in b.values())


def test_config_refuses_unknown_keys():
    with pytest.raises(ValueError, match="extra"):
        LatencyConfig(model="m", grpo_step=3)
