"""Convex Gated Probing (CGP): a prototype probe over all layers of a frozen encoder.

BAT / CGP (paper 12 in research/papers.md; official head ``CGP`` in houtan-ghaffari/BAT_ICML2026,
``models/heads.py``, MIT). For L layers of patch tokens x_ℓ (B, D, T, F) and CLS tokens c_ℓ (B, D),
each L2-normalised over D::

    a = softmax(w),  w = 1 at init             convex gate over layers (uniform 1/L at init)
    x̄ = Σ_ℓ a_ℓ x_ℓ,  c̄ = Σ_ℓ a_ℓ c_ℓ         (no re-normalisation after mixing, as in the code)
    p_j = prototype j / ‖prototype j‖,  j = 1..P
    act_j(t, f) = ⟨x̄(t, f), p_j⟩              (the code's conv1x1)
    features = [min_tf act_j, ⟨c̄, p_j⟩, max_tf act_j] interleaved per prototype → 3P
    logits = Linear(Dropout(features))

Without CLS (``use_cls=False``) the middle entry is the mean over patches. Why: a linear probe on
the last layer misses what the middle layers know; the gate learns which layer to read, and its
argmax names the task-relevant layer. Only w, the prototypes and the linear head are trained:
the encoder's features come in precomputed (frozen by construction).

Parameter names (``block_attention``, ``prototype_vectors`` of shape (P, D, 1, 1), ``fc``) and the
feature layout match the official head, so its state dict loads here unchanged. Our addition: an
optional patch mask (B, T, F) so padded text positions never win the min/max (with an all-true
mask the output is the official one). Training here uses cross-entropy for single-label tasks
(the paper uses an asymmetric loss for multi-label AudioSet); AdamW lr 1e-3 as in the paper.

For HF text encoders :func:`hf_layer_features` turns hidden states into (L, B, D, T, 1) patch
tokens (T = sequence positions) and a CLS token (the first or last real token, or the mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import nn

from closedloop.artifacts import ArrayInput, load_array
from closedloop.tool import Tool, tool
from closedloop.tool_models import ModelArg

__all__ = ["CGPProbe", "CGPFit", "fit_cgp", "hf_layer_features", "TOOLS"]

ClsPool = Literal["first", "last", "mean"]


class CGPProbe(nn.Module):
    """The CGP head. Input: patch tokens (L, B, D, T, F), CLS tokens (L, B, D), optional mask (B, T, F)."""

    def __init__(self, num_classes: int, dim: int, num_layers: int, num_prototypes: int = 10000,
                 use_cls: bool = True, dropout: float = 0.2) -> None:
        super().__init__()
        for name, v in (("num_classes", num_classes), ("dim", dim), ("num_layers", num_layers),
                        ("num_prototypes", num_prototypes)):
            if v < 1:
                raise ValueError(f"{name} must be ≥ 1, got {v}")
        self.num_layers, self.num_prototypes, self.use_cls = num_layers, num_prototypes, use_cls
        self.prototype_vectors = nn.Parameter(torch.randn(num_prototypes, dim, 1, 1) * 0.02)
        self.block_attention = nn.Parameter(torch.ones(num_layers))
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(3 * num_prototypes, num_classes)

    @property
    def gates(self) -> torch.Tensor:
        """a = softmax(w): non-negative, sums to one."""
        return torch.softmax(self.block_attention, dim=0)

    def features(self, patch: torch.Tensor, cls: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """The 3P similarity features (B, 3P), before dropout and the linear layer."""
        if patch.ndim != 5:
            raise ValueError(f"patch tokens must be (L, B, D, T, F), got shape {tuple(patch.shape)}")
        n_layers, b, d, t, f = patch.shape
        if n_layers != self.num_layers or d != self.prototype_vectors.shape[1]:
            raise ValueError(f"patch tokens {tuple(patch.shape)} do not fit a probe over {self.num_layers} "
                             f"layers of size {self.prototype_vectors.shape[1]}")
        if self.use_cls and (cls is None or tuple(cls.shape) != (n_layers, b, d)):
            raise ValueError(f"CLS tokens must be (L, B, D) = {(n_layers, b, d)}, got "
                             f"{None if cls is None else tuple(cls.shape)}")
        a = self.gates
        x = torch.einsum("l,lbdtf->bdtf", a, F.normalize(patch, dim=2))
        p = F.normalize(self.prototype_vectors, dim=1).flatten(1)  # P, D
        act = torch.einsum("bdtf,pd->bptf", x, p).reshape(b, self.num_prototypes, t * f)
        if mask is None:
            lo, hi = act.min(-1).values, act.max(-1).values
        else:
            m = mask.reshape(b, 1, t * f).to(torch.bool)
            if not bool(m.any(-1).all()):
                raise ValueError("every example needs at least one unmasked patch")
            lo = act.masked_fill(~m, math.inf).min(-1).values
            hi = act.masked_fill(~m, -math.inf).max(-1).values
        if self.use_cls:
            assert cls is not None  # use_cls without CLS tokens raised above
            middle = torch.einsum("l,lbd->bd", a, F.normalize(cls, dim=2)) @ p.T
        elif mask is None:
            middle = act.mean(-1)
        else:
            middle = (act * m).sum(-1) / m.sum(-1)
        return torch.stack([lo, middle, hi], dim=-1).reshape(b, 3 * self.num_prototypes)

    def forward(self, patch: torch.Tensor, cls: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(self.dropout(self.features(patch, cls, mask)))


@dataclass
class CGPFit:
    probe: CGPProbe
    gates: np.ndarray
    best_layer: int
    losses: list[float]
    train_accuracy: float


def _check(name: str, x: torch.Tensor) -> None:
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or infinite values")


def fit_cgp(patch: torch.Tensor, cls: torch.Tensor | None, labels: torch.Tensor, *, mask: torch.Tensor | None = None,
            num_prototypes: int = 64, steps: int = 200, lr: float = 1e-3, weight_decay: float = 0.05,
            dropout: float = 0.2, seed: int = 0, batch_size: int | None = None) -> CGPFit:
    """Train gates, prototypes and head on frozen features (full batch unless ``batch_size``)."""
    _check("patch tokens", patch)
    if cls is not None:
        _check("CLS tokens", cls)
    labels = labels.long()
    if labels.ndim != 1 or labels.shape[0] != patch.shape[1]:
        raise ValueError(f"labels must be ({patch.shape[1]},) to match the batch, got {tuple(labels.shape)}")
    if int(labels.min()) < 0:
        raise ValueError("labels must be class indices ≥ 0")
    torch.manual_seed(seed)
    n_classes = int(labels.max()) + 1
    probe = CGPProbe(n_classes, patch.shape[2], patch.shape[0], num_prototypes, use_cls=cls is not None,
                     dropout=dropout)
    patch, cls = patch.detach(), None if cls is None else cls.detach()  # the encoder stays frozen
    opt = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(seed)
    n = labels.shape[0]
    losses = []
    probe.train()
    for _ in range(steps):
        idx = torch.randperm(n, generator=g)[:batch_size] if batch_size else torch.arange(n)
        logits = probe(patch[:, idx], None if cls is None else cls[:, idx], None if mask is None else mask[idx])
        loss = F.cross_entropy(logits, labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    probe.eval()
    with torch.no_grad():
        acc = float((probe(patch, cls, mask).argmax(-1) == labels).float().mean())
        gates = probe.gates.numpy().copy()
    return CGPFit(probe, gates, int(gates.argmax()), losses, acc)


@torch.no_grad()
def hf_layer_features(model, tokenizer, texts: Sequence[str], *, cls_pool: ClsPool = "last",
                      include_embeddings: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states of an HF model as CGP inputs: patch (L, B, D, T, 1), CLS (L, B, D), mask (B, T, 1)."""
    if not texts:
        raise ValueError("no texts")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    enc = tokenizer(list(texts), return_tensors="pt", padding=True)
    if int(enc["attention_mask"].sum(1).min()) == 0:
        raise ValueError("an input text is empty after tokenisation")
    out = model(**enc, output_hidden_states=True)
    hs = torch.stack(out.hidden_states[0 if include_embeddings else 1:]).float()  # L, B, T, D
    m = enc["attention_mask"].bool()
    if cls_pool == "first":
        cls = hs[:, :, 0]
    elif cls_pool == "last":
        last = m.sum(1) - 1
        cls = hs[:, torch.arange(hs.shape[1]), last]
    else:
        cls = (hs * m[None, :, :, None]).sum(2) / m.sum(1)[None, :, None]
    return hs.permute(0, 1, 3, 2).unsqueeze(-1).contiguous(), cls, m.unsqueeze(-1)


# ---------------------------------------------------------------------------------- tools


class CGPReport(BaseModel):
    gates: list[float]
    best_layer: int
    n_layers: int
    feature_dim: int
    train_accuracy: float
    final_loss: float


def _report(fit: CGPFit) -> CGPReport:
    return CGPReport(gates=[float(x) for x in fit.gates], best_layer=fit.best_layer, n_layers=len(fit.gates),
                     feature_dim=3 * fit.probe.num_prototypes, train_accuracy=fit.train_accuracy,
                     final_loss=fit.losses[-1])


Steps = Annotated[int, Field(ge=1, le=100_000)]
Protos = Annotated[int, Field(ge=1, le=20_000)]


@tool(timeout_s=600)
def cgp_probe_features(patch_tokens: ArrayInput, labels: ArrayInput, cls_tokens: ArrayInput | None = None,
                       num_prototypes: Protos = 64, steps: Steps = 200,
                       lr: Annotated[float, Field(gt=0)] = 1e-3, seed: int = 0) -> CGPReport:
    """Fit a convex gated prototype probe on frozen per-layer features; report the gates and best layer.

    Args:
        patch_tokens: (L, N, T, D) per-layer token features, or (L, N, D, T, F) as in the official head: .npy/.npz/.safetensors path or inline list.
        labels: (N,) integer class labels.
        cls_tokens: Optional (L, N, D) per-layer CLS features; without them the mean over tokens is used.
        num_prototypes: P; the head sees 3P features.
        steps: Full-batch AdamW steps.
        lr: Learning rate.
        seed: Seed for prototypes, head and dropout.
    """
    patch = torch.as_tensor(load_array(patch_tokens, name="patch_tokens"), dtype=torch.float32)
    if patch.ndim == 4:
        patch = patch.permute(0, 1, 3, 2).unsqueeze(-1)
    elif patch.ndim != 5:
        raise ValueError(f"patch_tokens must be (L, N, T, D) or (L, N, D, T, F), got shape {tuple(patch.shape)}")
    y = load_array(labels, name="labels")
    if y.ndim != 1 or not np.all(y == np.round(y)):
        raise ValueError("labels must be a 1-D list of integer classes")
    cls = None
    if cls_tokens is not None:
        cls = torch.as_tensor(load_array(cls_tokens, name="cls_tokens"), dtype=torch.float32)
        if tuple(cls.shape) != (patch.shape[0], patch.shape[1], patch.shape[2]):
            raise ValueError(f"cls_tokens must be (L, N, D) = {tuple(patch.shape[:3])}, got {tuple(cls.shape)}")
    fit = fit_cgp(patch, cls, torch.as_tensor(y).long(), num_prototypes=num_prototypes, steps=steps, lr=lr, seed=seed)
    return _report(fit)


@tool(timeout_s=600)
def cgp_probe_hf(model: ModelArg, texts: Annotated[list[str], Field(min_length=2)], labels: list[int],
                 cls_pool: ClsPool = "last", num_prototypes: Protos = 64, steps: Steps = 200,
                 lr: Annotated[float, Field(gt=0)] = 1e-3, seed: int = 0) -> CGPReport:
    """Which layer of an HF model knows the label: CGP probe on its frozen hidden states.

    Args:
        model: hf:<checkpoint directory inside the working root> (any AutoModel with hidden states).
        texts: Inputs, one per example.
        labels: Integer class per text.
        cls_pool: Which token stands in for CLS: 'first', 'last' (causal LMs) or 'mean'.
        num_prototypes: P; the head sees 3P features.
        steps: Full-batch AdamW steps.
        lr: Learning rate.
        seed: Seed for prototypes, head and dropout.
    """
    from transformers import AutoModel, AutoTokenizer

    from closedloop.models import parse_spec

    if len(labels) != len(texts):
        raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
    s = parse_spec(model)
    if s.backend != "hf":
        raise ValueError(f"need an hf:<path> model spec, got {model!r}")
    enc = AutoModel.from_pretrained(s.model, dtype=torch.float32).eval()
    patch, cls, mask = hf_layer_features(enc, AutoTokenizer.from_pretrained(s.model), texts, cls_pool=cls_pool)
    fit = fit_cgp(patch, cls, torch.tensor(labels), mask=mask, num_prototypes=num_prototypes, steps=steps, lr=lr,
                  seed=seed)
    return _report(fit)


TOOLS: list[Tool] = [cgp_probe_features, cgp_probe_hf]
