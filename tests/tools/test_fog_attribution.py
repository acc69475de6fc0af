"""FoG-A forward-only gate ablation: Δ per residual block and the top-K layer selection."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from torch import nn

from closedloop.tool import ToolRegistry
from closedloop.tools.fog_attribution import (TOOLS, LayerSelection, capture_blocks, fog_deltas, find_blocks, repa_loss,
                                             select_layers, skip_block)


class Block(nn.Module):
    """x + scale · MLP(x): scale 0 makes the residual branch output zero."""

    def __init__(self, d: int, scale: float = 1.0) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.scale = scale

    def forward(self, x):
        return x + self.scale * self.mlp(x)


class Stack(nn.Module):
    def __init__(self, scales, d: int = 8, head_scale: float = 1.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, s) for s in scales)
        self.head = nn.Linear(d, 3)
        self.head_scale = head_scale

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head_scale * self.head(x)


def batches(n=3, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, d, generator=g) for _ in range(n)]


def test_zero_residual_branch_gives_zero_delta_and_others_positive():
    torch.manual_seed(0)
    model = Stack([1.0, 0.0, 0.5, 0.0])
    d = fog_deltas(model, model.blocks, batches())
    assert d[1] == 0 and d[3] == 0
    assert d[0] > 1e-3 and d[2] > 1e-3


def test_delta_matches_manual_skip():
    torch.manual_seed(1)
    model = Stack([1.0, 0.7, 0.3])
    x = batches(1)[0]
    v = model(x)
    # Skipping block 1 by hand: run the stack without it.
    h = model.blocks[0](x)
    h = model.blocks[2](h)
    v_minus = model.head(h)
    manual = float(torch.as_tensor(((v_minus - v) ** 2).mean().sqrt() / (v ** 2).mean().sqrt()).detach())
    assert fog_deltas(model, model.blocks, [x])[1] == pytest.approx(manual, rel=1e-6)


@pytest.mark.parametrize("c", [0.01, -3.0, 250.0])
def test_delta_is_invariant_to_rescaling_the_head(c):
    torch.manual_seed(2)
    model = Stack([1.0, 0.4, 0.8])
    base = fog_deltas(model, model.blocks, batches())
    model.head_scale = c
    np.testing.assert_allclose(fog_deltas(model, model.blocks, batches()), base, rtol=1e-5)  # float32 forward


def test_skip_block_restores_the_block_and_rejects_non_residual():
    torch.manual_seed(3)
    model = Stack([1.0])
    x = batches(1)[0]
    before = model(x)
    with skip_block(model.blocks[0]):
        torch.testing.assert_close(model(x), model.head(x))
    torch.testing.assert_close(model(x), before)
    proj = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="not a residual block"), skip_block(proj):
        proj(x)


def test_zero_output_is_a_clear_error():
    model = Stack([1.0], head_scale=0.0)
    with pytest.raises(ValueError, match="zero or non-finite"):
        fog_deltas(model, model.blocks, batches(1))


def test_select_layers_topk_and_weights_proportional_to_delta():
    d = [0.1, 0.5, 0.0, 0.3, 0.3]
    s = select_layers(d, 3)
    assert s.layers == (1, 3, 4)
    np.testing.assert_allclose(s.weights, np.array([0.5, 0.3, 0.3]) / 1.1)
    assert select_layers(d, 2, "all").weights == pytest.approx((0.5 / 1.2, 0.3 / 1.2))
    assert select_layers(d, 1, "none").weights == (0.5,)
    with pytest.raises(ValueError, match="k must be"):
        select_layers(d, 6)
    with pytest.raises(ValueError, match="finite"):
        select_layers([0.1, float("nan")], 1)
    with pytest.raises(ValueError, match="all selected"):
        select_layers([0.0, 0.0], 1)
    with pytest.raises(AttributeError):  # the probe result is frozen before phase 2
        s.layers = (0,)  # type: ignore[misc]


def test_hf_tool_on_tiny_model(tiny_model_path):
    torch.set_num_threads(1)
    reg = ToolRegistry().extend(TOOLS)
    args = {"model": f"hf:{tiny_model_path}", "texts": ["hello there", "call the weather tool"], "k": 2}
    res = asyncio.run(reg.get("fog_layer_attribution").run(args))
    assert res.ok, res.error
    out = json.loads(res.content)
    assert out["n_layers"] == len(out["deltas"]) >= 2
    assert all(x > 0 for x in out["deltas"])  # every trained layer contributes something
    assert len(out["layers"]) == 2 and sum(out["weights"]) == pytest.approx(1.0)
    assert out["layers"][0] == int(np.argmax(out["deltas"]))


def test_tool_errors_are_clear(tiny_model_path):
    reg = ToolRegistry().extend(TOOLS)
    bad = asyncio.run(reg.get("fog_layer_attribution").run({"model": f"hf:{tiny_model_path}", "texts": ["x"], "k": 99}))
    assert not bad.ok and "layers" in bad.error
    bad = asyncio.run(reg.get("fog_select_layers").run({"deltas": [0.1, -1.0], "k": 1}))
    assert not bad.ok and "non-negative" in bad.error
    assert len(find_blocks(Stack([1.0, 1.0, 1.0]))) == 3


def test_capture_blocks_records_the_selected_outputs_with_their_graph_and_unhooks():
    torch.manual_seed(0)
    stack = Stack([1.0, 1.0, 1.0])
    x = torch.randn(5, 8)
    with capture_blocks(stack.blocks, [2, 0, 2]) as found:
        stack(x)
    assert sorted(found) == [0, 2] and found[0].requires_grad
    assert torch.allclose(found[0], stack.blocks[0](x))
    assert all(not b._forward_hooks for b in stack.blocks)  # nothing left behind
    with pytest.raises(ValueError, match="layer 3"):
        with capture_blocks(stack.blocks, [3]):
            pass


def test_repa_loss_is_the_lambda_weighted_negative_cosine():
    torch.manual_seed(0)
    hidden = {1: torch.randn(6, 8), 4: torch.randn(6, 8)}
    teacher = torch.randn(6, 3)
    proj = {1: nn.Linear(8, 3), 4: nn.Linear(8, 3)}
    sel = LayerSelection((4, 1), (0.75, 0.25), (0.0,) * 5)
    expected = sum(w * -nn.functional.cosine_similarity(proj[k](hidden[k]), teacher, dim=-1).mean()
                   for k, w in ((4, 0.75), (1, 0.25)))
    assert torch.allclose(repa_loss(hidden, teacher, proj, sel), expected)
    assert torch.allclose(repa_loss(hidden, teacher, proj, ((1,), (1.0,))),
                          -nn.functional.cosine_similarity(proj[1](hidden[1]), teacher, dim=-1).mean())
    with pytest.raises(KeyError, match="layer 2"):
        repa_loss(hidden, teacher, {2: proj[1]}, ((2,), (1.0,)))
    with pytest.raises(ValueError, match="one weight per layer"):
        repa_loss(hidden, teacher, proj, ((1, 4), (1.0,)))
