"""The trainers' optimizer: AdamW with the config's settings, weight decay on matrices only, and on
the CPU the multi-tensor (foreach) update, which must compute exactly what torch's default
single-tensor loop computes."""

from __future__ import annotations

import torch

from closedloop.trainers.common import build_optimizer
from closedloop.trainers.config import TrainConfig


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def test_the_cpu_optimizer_equals_single_tensor_adamw_with_the_configs_settings():
    cfg = TrainConfig(model="m", output_dir="o", learning_rate=3e-2, weight_decay=0.1, adam_beta1=0.8,
                      adam_beta2=0.95, adam_epsilon=1e-6)
    ours_model, ref_model = _model(), _model()
    ours = build_optimizer(ours_model, cfg)
    assert all(g["foreach"] for g in ours.param_groups)
    decay = [p for p in ref_model.parameters() if p.ndim >= 2]
    no_decay = [p for p in ref_model.parameters() if p.ndim < 2]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-2, betas=(0.8, 0.95), eps=1e-6, foreach=False)
    x = torch.randn(16, 6)
    for _ in range(5):
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(ours_model[0].weight, _model()[0].weight)  # it did train


def test_frozen_parameters_are_left_out():
    model = _model()
    model[0].requires_grad_(False)
    frozen = {id(p) for p in model[0].parameters()}
    opt = build_optimizer(model, TrainConfig(model="m", output_dir="o"))
    assert not any(id(p) in frozen for g in opt.param_groups for p in g["params"])
