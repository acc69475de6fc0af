"""FoG-A: forward-only gate ablation, which layer of a residual stack the output depends on.

AG-REPA (paper 13 in research/papers.md; official code zpforlove/AG-REPA, MIT, not reachable
here so this follows the paper's equations)::

    v      = f(x)               the full network's output (AG-REPA: the velocity v_θ(x_t, t, c))
    v_{−ℓ} = f(x) with block ℓ skipped, i.e. replaced by the identity on its residual stream
    Δ_ℓ    = RMS(v_{−ℓ} − v) / RMS(v),   averaged over the probe batches (a "domain")

then the top-K layers by Δ are aligned, with λ_k ∝ Δ_k. Why forward-only: a layer that *stores*
the most (high probe similarity) may *contribute* little to the output ("store–contribute
dissociation"); knocking it out measures contribution directly, with K + 1 forward passes per
batch instead of any training. Probe-then-intervene: the layer set is chosen once, before any
phase-2 training, and then frozen (:class:`LayerSelection` is immutable). Phase 2 (REPA on the
selected layers): :func:`capture_blocks` records the selected blocks' outputs during the training
forward and :func:`repa_loss` is the weighted alignment term added to the flow-matching loss
(the experiment: ``benchmarks/recipes/ag_repa.yaml``).

Works on any PyTorch module whose blocks map the residual stream to the residual stream (first
positional argument in, first output out, tuples allowed, as in HF decoder layers). Properties:
Δ_ℓ = 0 for a block whose residual branch outputs zero; Δ is unchanged when the output head is
rescaled (both numerator and denominator scale by |c|).

Normalisation of λ: λ_k = Δ_k / Σ_{j ∈ top-K} Δ_j by default (``normalize="topk"``, sums to 1);
``normalize="all"`` divides by Σ over all layers and ``"none"`` keeps λ_k = Δ_k. The released
AG-REPA weights (0.334/0.139/0.118) sum to 0.59, so they are not top-K-normalised; which scale
the official code uses could not be checked here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Iterable, Literal, Sequence

import numpy as np
import torch
from pydantic import BaseModel, Field
from torch import nn

from closedloop.tool import Tool, tool
from closedloop.tool_models import ModelArg

__all__ = ["skip_block", "fog_deltas", "select_layers", "LayerSelection", "find_blocks", "load_hf_stack",
           "capture_blocks", "repa_loss", "TOOLS"]

Normalize = Literal["topk", "all", "none"]


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.double().pow(2).mean().sqrt()


@contextlib.contextmanager
def skip_block(block: nn.Module):
    """Inside the context ``block`` is the identity on its residual stream (first input → first output)."""

    def hook(module, args, kwargs, output):
        if args:
            x = args[0]
        elif "hidden_states" in kwargs:
            x = kwargs["hidden_states"]
        else:
            raise TypeError(f"{type(module).__name__} got its residual stream neither positionally nor as hidden_states")
        if isinstance(output, tuple):
            return (x,) + tuple(output[1:])
        if isinstance(output, torch.Tensor):
            if output.shape != x.shape:
                raise ValueError(f"block output {tuple(output.shape)} differs from its input {tuple(x.shape)}: "
                                 "not a residual block, cannot skip it")
            return x
        raise TypeError(f"cannot skip a block that returns {type(output).__name__}")

    handle = block.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _output_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for attr in ("logits", "last_hidden_state", "sample"):
        if getattr(out, attr, None) is not None:
            return getattr(out, attr)
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot take a tensor out of the model output {type(out).__name__}")


@torch.no_grad()
def fog_deltas(model: Callable[..., Any], blocks: Sequence[nn.Module] | nn.ModuleList, batches: Iterable[Any],
               call: Callable[[Callable[..., Any], Any], Any] | None = None) -> np.ndarray:
    """Δ_ℓ = RMS(v_{−ℓ} − v) / RMS(v) for every block, averaged over ``batches``.

    Args:
        model: any callable module; ``call(model, batch)`` (default ``model(batch)``, or
            ``model(**batch)`` for a dict) gives the output v (a tensor or an HF output with logits).
        blocks: the residual blocks, in order.
        batches: the probe inputs (one domain).
    """
    if len(blocks) == 0:
        raise ValueError("no blocks to attribute")
    call = call or (lambda m, b: m(**b) if isinstance(b, dict) else m(b))
    sums = np.zeros(len(blocks))
    n = 0
    for batch in batches:
        v = _output_tensor(call(model, batch))
        ref = _rms(v)
        if not torch.isfinite(ref) or float(ref) == 0.0:
            raise ValueError("the model output is zero or non-finite: Δ = RMS(v₋ℓ − v)/RMS(v) is undefined")
        for i, block in enumerate(blocks):
            with skip_block(block):
                v_minus = _output_tensor(call(model, batch))
            sums[i] += float(_rms(v_minus - v) / ref)
        n += 1
    if n == 0:
        raise ValueError("no probe batches given")
    return sums / n


@dataclass(frozen=True)
class LayerSelection:
    """The frozen probe result: which layers to align and with what weight."""

    layers: tuple[int, ...]
    weights: tuple[float, ...]
    deltas: tuple[float, ...]


def select_layers(deltas: Sequence[float] | np.ndarray, k: int = 3, normalize: Normalize = "topk") -> LayerSelection:
    """Top-k layers by Δ (largest first, ties to the lower index) with λ_k ∝ Δ_k."""
    d = np.asarray(deltas, dtype=float)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"deltas must be a non-empty 1-D list, got shape {d.shape}")
    if not np.all(np.isfinite(d)) or np.any(d < 0):
        raise ValueError("deltas must be finite and non-negative")
    if not 1 <= k <= d.size:
        raise ValueError(f"k must be in 1..{d.size}, got {k}")
    order = np.argsort(-d, kind="stable")[:k]
    top = d[order]
    denom = {"topk": top.sum(), "all": d.sum(), "none": 1.0}[normalize]
    if denom == 0:
        raise ValueError("all selected Δ are zero: no layer contributes, nothing to weight")
    return LayerSelection(tuple(int(i) for i in order), tuple(float(w) for w in top / denom), tuple(float(x) for x in d))


@contextlib.contextmanager
def capture_blocks(blocks: Sequence[nn.Module] | nn.ModuleList, layers: Iterable[int]):
    """Inside the context, every forward stores block ℓ's output (the residual stream after it,
    the first element of a tuple output) in the yielded dict under ℓ, with its graph: what REPA
    aligns. Phase 2 of AG-REPA reads the layers of a frozen :class:`LayerSelection` this way."""
    found: dict[int, torch.Tensor] = {}
    handles = []
    for layer in dict.fromkeys(int(i) for i in layers):
        if not 0 <= layer < len(blocks):
            raise ValueError(f"layer {layer} is not one of the {len(blocks)} blocks")

        def hook(module, args, output, layer=layer):
            found[layer] = output[0] if isinstance(output, tuple) else output

        handles.append(blocks[layer].register_forward_hook(hook))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def repa_loss(hidden: dict[int, torch.Tensor], teacher: torch.Tensor, projectors: dict[int, nn.Module] | Any,
              selection: LayerSelection | tuple[Sequence[int], Sequence[float]]) -> torch.Tensor:
    """REPA's alignment term Σ_k λ_k · mean(−cos(MLP_k(h_k), y)) over the selected layers.

    ``hidden`` as :func:`capture_blocks` fills it; ``teacher`` y has the hidden states' leading
    shape (…, D_teacher); ``projectors[k]`` maps block k's width to D_teacher (REPA: a small MLP,
    trained with the model and dropped after training); ``selection`` gives the layers and their
    λ (AG-REPA: λ_k ∝ FoG-A Δ_k; fixed-layer REPA: the chosen layers, usually one with λ = 1).
    """
    layers, weights = (selection.layers, selection.weights) if isinstance(selection, LayerSelection) else selection
    if len(layers) != len(weights) or not len(layers):
        raise ValueError(f"need one weight per layer and at least one layer, got {list(layers)} and {list(weights)}")
    total = teacher.new_zeros(())
    for layer, weight in zip(layers, weights):
        if layer not in hidden:
            raise KeyError(f"no hidden state captured for layer {layer} (capture it with capture_blocks)")
        pred = projectors[layer](hidden[layer])
        if pred.shape != teacher.shape:
            raise ValueError(f"projector of layer {layer} gives {tuple(pred.shape)}, teacher is {tuple(teacher.shape)}")
        total = total + float(weight) * -nn.functional.cosine_similarity(pred, teacher, dim=-1).mean()
    return total


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The longest ``nn.ModuleList`` in the model: the decoder layers of an HF transformer."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks")
    return max(lists, key=len)


def load_hf_stack(spec: str):
    """``hf:<dir>`` → (causal LM in eval mode, tokenizer). Local directories only (no hub access)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from closedloop.models import parse_spec

    s = parse_spec(spec)
    if s.backend != "hf":
        raise ValueError(f"need an hf:<path> model spec, got {spec!r}")
    model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(s.model)


# ---------------------------------------------------------------------------------- tools


class FogReport(BaseModel):
    model: str
    n_layers: int
    deltas: list[float]
    layers: list[int]
    weights: list[float]
    normalize: str


@tool(timeout_s=600)
def fog_layer_attribution(model: ModelArg, texts: Annotated[list[str], Field(min_length=1)],
                          k: Annotated[int, Field(ge=1)] = 3, normalize: Normalize = "topk") -> FogReport:
    """Forward-only gate ablation of an HF causal LM: Δ per decoder layer and the top-k layers.

    Δ_ℓ = RMS(logits with layer ℓ skipped − logits) / RMS(logits), averaged over the texts;
    the selected layers get weights λ ∝ Δ.

    Args:
        model: hf:<checkpoint directory inside the working root>.
        texts: Probe texts (one domain); each is run alone.
        k: How many layers to select.
        normalize: 'topk' (λ sums to 1 over the selection), 'all' (divide by ΣΔ) or 'none' (λ = Δ).
    """
    lm, tok = load_hf_stack(model)
    blocks = find_blocks(lm)
    if k > len(blocks):
        raise ValueError(f"k={k} but the model has {len(blocks)} layers")
    batches = [dict(tok(t, return_tensors="pt")) for t in texts]
    if any(b["input_ids"].shape[1] == 0 for b in batches):
        raise ValueError("empty probe text")
    deltas = fog_deltas(lm, blocks, batches)
    sel = select_layers(deltas, k, normalize)
    return FogReport(model=model, n_layers=len(blocks), deltas=list(sel.deltas), layers=list(sel.layers),
                     weights=list(sel.weights), normalize=normalize)


class SelectionReport(BaseModel):
    layers: list[int]
    weights: list[float]


@tool
def fog_select_layers(deltas: Annotated[list[float], Field(min_length=1)], k: Annotated[int, Field(ge=1)] = 3,
                      normalize: Normalize = "topk") -> SelectionReport:
    """Top-k layers by FoG-A Δ with alignment weights λ_k ∝ Δ_k.

    Args:
        deltas: Δ per layer (finite, ≥ 0).
        k: How many layers to select.
        normalize: 'topk' (λ sums to 1), 'all' (divide by ΣΔ) or 'none' (λ = Δ).
    """
    sel = select_layers(deltas, k, normalize)
    return SelectionReport(layers=list(sel.layers), weights=list(sel.weights))


TOOLS: list[Tool] = [fog_layer_attribution, fog_select_layers]
