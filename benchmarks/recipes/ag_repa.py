"""AG-REPA (paper 13, arXiv 2603.01006): representation alignment on the layers FoG-A selects,
against alignment on layers chosen by position. A toy, and stated as one.

Claim tested: "alignment is most effective when applied to the causally dominant layers that
drive the velocity field": REPA on the top-K layers by FoG-A Δ (λ_k ∝ Δ_k) gives generations
closer to the data (the paper: FAD −18% speech, −16% audio) than REPA on layers picked by depth.

Setup (one replicate per seed; every arm of a seed sees the same data, start and batches):

* **Data.** Token-conditioned "frames": x ∈ R^64 of class c (6 tokens) from 3 latent factors z,
  x = A_c·[sin 2z, tanh 1.5z] + 0.5·μ_c + 0.05·noise (A_c, μ_c random per class and seed). The
  teacher (standing in for Whisper/BEATs: a frozen encoder of the *clean* sample) is a frozen
  random two-layer MLP of z (16 features): it knows what the sample is, not how to denoise it.
* **Model.** A DiT-like velocity network: input projection, 8 residual blocks
  h ← h + MLP(adaLN(h; t, c)), output head; rectified flow, x_t = t·x₁ + (1 − t)·x₀, data at
  t = 1, noise at t = 0, v = x₁ − x₀, loss ‖v_θ − v‖².
* **Probe, then intervene** (the paper's protocol). Phase 1: ``warmup_steps`` of plain flow
  matching. FoG-A (``tools/fog_attribution.fog_deltas``) at t = ``probe_t`` on held-out probe
  batches gives Δ per block; ``select_layers`` freezes the top-K with λ ∝ Δ. Phase 2: every arm
  continues from the phase-1 weights for ``steps`` more, loss = FM + ``repa_weight`` · REPA
  (``tools/fog_attribution.repa_loss``: Σ λ_k · −cos(MLP_k(h_k), teacher)) on its layers:

  | arm | layers | λ |
  |---|---|---|
  | none | (no alignment) | |
  | ag-repa | top-K by FoG-A Δ | ∝ Δ, summing to 1 |
  | repa-l3 | the block at depth ⌊L/3⌋ (REPA's usual heuristic: layer 8 of SiT's 28) | 1 |
  | shallow | the first K blocks | 1/K each |
  | deep | the last K blocks | 1/K each |

* **Metric.** The paper's FAD is a Fréchet distance between embeddings of generated and real
  audio. Here: the Fréchet distance (``tools/starcaster.frechet_distance``) between
  ``samples`` generated frames (Euler, ``sample_steps`` steps, classes balanced) and ``test``
  held-out real frames, in data space (``fd``), and the mean over classes of the per-class
  distance (``fd_class``: conditional quality). Lower is better.
* Also recorded: the "store" profile (ridge-probe R² of the teacher features from each block's
  output at t = ``probe_t``, after phase 1) beside FoG-A's "contribute" profile Δ, to show
  whether this toy has the store–contribute dissociation the paper reports.

Deliberate differences from the paper: vectors instead of mel-spectrogram sequences, an MLP
DiT instead of a 24-layer transformer, an oracle-like teacher, ~10³ steps. Results and what
they suggest: ``docs/results/ag_repa/``.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from closedloop.tools.fog_attribution import LayerSelection, capture_blocks, fog_deltas, repa_loss, select_layers
from closedloop.tools.starcaster import frechet_distance, gaussian_fit
from closedloop.trainers.recipes import StageContext, StageKind

ARMS = ("none", "ag-repa", "repa-l3", "shallow", "deep")


class Seed(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seed: int
    dim: int = 64
    latent: int = 3
    classes: int = 6
    teacher_dim: int = 16
    width: int = 96
    depth: int = Field(8, ge=2)
    k: int = Field(3, ge=1)
    warmup_steps: int = Field(300, ge=1)
    steps: int = Field(600, ge=1)
    batch: int = 256
    lr: float = 1e-3
    repa_weight: float = 0.5
    probe_t: float = Field(0.8, ge=0.0, le=1.0)
    probe_batches: int = 4
    samples: int = 3000
    test: int = 4000
    sample_steps: int = 32
    arms: list[str] = list(ARMS)


# --------------------------------------------------------------------------- data and model


class Task:
    """The seed's data distribution and its frozen teacher."""

    def __init__(self, cfg: Seed) -> None:
        g = torch.Generator().manual_seed(cfg.seed)
        self.cfg = cfg
        self.mix = torch.randn(cfg.classes, 2 * cfg.latent, cfg.dim, generator=g) / math.sqrt(cfg.latent)
        self.mean = torch.randn(cfg.classes, cfg.dim, generator=g)
        self.teacher = nn.Sequential(nn.Linear(cfg.latent, 32), nn.Tanh(), nn.Linear(32, cfg.teacher_dim))
        with torch.no_grad():
            for p in self.teacher.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(max(1, p.shape[-1])))
        self.teacher.requires_grad_(False)

    def sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, class, teacher features)."""
        c = torch.randint(0, self.cfg.classes, (n,), generator=gen)
        z = torch.randn(n, self.cfg.latent, generator=gen)
        feats = torch.cat([torch.sin(2 * z), torch.tanh(1.5 * z)], 1)
        x = torch.einsum("nf,nfd->nd", feats, self.mix[c]) + 0.5 * self.mean[c]
        x = x + 0.05 * torch.randn(n, self.cfg.dim, generator=gen)
        with torch.no_grad():
            return x, c, self.teacher(z)


class Block(nn.Module):
    """h + MLP(LayerNorm(h)·(1 + a) + b), (a, b) from the time and token embedding (adaLN)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mod = nn.Linear(width, 2 * width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, width))

    def forward(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        a, b = self.mod(cond).chunk(2, -1)
        return h + self.mlp(self.norm(h) * (1 + a) + b)


class VelocityNet(nn.Module):
    def __init__(self, cfg: Seed) -> None:
        super().__init__()
        w = cfg.width
        self.inp = nn.Linear(cfg.dim, w)
        self.time = nn.Sequential(nn.Linear(16, w), nn.SiLU(), nn.Linear(w, w))
        self.token = nn.Embedding(cfg.classes, w)
        self.blocks = nn.ModuleList(Block(w) for _ in range(cfg.depth))
        self.out = nn.Sequential(nn.LayerNorm(w), nn.Linear(w, cfg.dim))
        self.register_buffer("freqs", torch.exp(torch.linspace(0, math.log(100), 8)))

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        emb = torch.cat([torch.sin(t[:, None] * self.freqs), torch.cos(t[:, None] * self.freqs)], 1)
        cond = self.time(emb) + self.token(c)
        h = self.inp(x) + cond
        for block in self.blocks:
            h = block(h, cond)
        return self.out(h)


def _interpolate(x1: torch.Tensor, t: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x0 = torch.randn(x1.shape, generator=gen)
    return t[:, None] * x1 + (1 - t[:, None]) * x0, x1 - x0


@torch.no_grad()
def generate(net: VelocityNet, cfg: Seed, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Euler from noise (t = 0) to data (t = 1), classes balanced."""
    c = torch.arange(cfg.samples) % cfg.classes
    x = torch.randn(cfg.samples, cfg.dim, generator=gen)
    for i in range(cfg.sample_steps):
        x = x + net(x, torch.full((cfg.samples,), i / cfg.sample_steps), c) / cfg.sample_steps
    return x, c


def _fd(a: torch.Tensor, b: torch.Tensor) -> float:
    return frechet_distance(*gaussian_fit(a.double().numpy()), *gaussian_fit(b.double().numpy()))


def store_profile(net: VelocityNet, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                  teacher: torch.Tensor, ridge: float = 1e-2) -> list[float]:
    """Held-out R² of a ridge probe from each block's output to the teacher features."""
    hidden: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(net.blocks))}
    with torch.no_grad(), capture_blocks(net.blocks, range(len(net.blocks))) as found:
        for batch in batches:
            net(*batch)
            for i in hidden:
                hidden[i].append(found[i])
    y = teacher.double()
    half = len(y) // 2
    scores = []
    for i in hidden:
        h = torch.cat(hidden[i]).double()
        h = torch.cat([h, torch.ones(len(h), 1, dtype=h.dtype)], 1)
        a, b = h[:half], h[half:]
        w = torch.linalg.solve(a.T @ a + ridge * torch.eye(a.shape[1], dtype=a.dtype), a.T @ y[:half])
        resid = ((b @ w - y[half:]) ** 2).sum()
        scores.append(float(1 - resid / ((y[half:] - y[half:].mean(0)) ** 2).sum()))
    return scores


# --------------------------------------------------------------------------- one replicate


def arm_layers(arm: str, cfg: Seed, fog: LayerSelection) -> tuple[tuple[int, ...], tuple[float, ...]]:
    k, depth = cfg.k, cfg.depth
    if arm == "none":
        return (), ()
    if arm == "ag-repa":
        return fog.layers, fog.weights
    if arm == "repa-l3":
        return (depth // 3,), (1.0,)
    if arm == "shallow":
        return tuple(range(k)), (1.0 / k,) * k
    if arm == "deep":
        return tuple(range(depth - k, depth)), (1.0 / k,) * k
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


def _train(net: VelocityNet, task: Task, cfg: Seed, steps: int, layers: tuple[int, ...], weights: tuple[float, ...],
           seed: int) -> None:
    torch.manual_seed(seed)
    projectors = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.SiLU(),
                                                      nn.Linear(cfg.width, cfg.teacher_dim)) for i in layers})
    opt = torch.optim.AdamW([*net.parameters(), *projectors.parameters()], lr=cfg.lr)
    gen = torch.Generator().manual_seed(seed)
    net.train()
    for _ in range(steps):
        x1, c, teacher = task.sample(cfg.batch, gen)
        t = torch.rand(cfg.batch, generator=gen)
        xt, target = _interpolate(x1, t, gen)
        with capture_blocks(net.blocks, layers) as hidden:
            loss = F.mse_loss(net(xt, t, c), target)
        if layers:
            loss = loss + cfg.repa_weight * repa_loss(hidden, teacher, {i: projectors[str(i)] for i in layers},
                                                      (layers, weights))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    net.eval()


def _run(cfg: Seed, ctx: StageContext) -> dict[str, Any]:
    unknown = set(cfg.arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arm(s) {sorted(unknown)}; known: {', '.join(ARMS)}")
    cpu0 = time.process_time()
    task = Task(cfg)
    torch.manual_seed(cfg.seed)
    net = VelocityNet(cfg)
    _train(net, task, cfg, cfg.warmup_steps, (), (), seed=cfg.seed * 1000 + 1)

    # Probe (held-out batches at t = probe_t), then freeze the selection.
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + 2)
    batches, teachers = [], []
    for _ in range(cfg.probe_batches):
        x1, c, teacher = task.sample(cfg.batch, gen)
        t = torch.full((cfg.batch,), cfg.probe_t)
        batches.append((_interpolate(x1, t, gen)[0], t, c))
        teachers.append(teacher)
    deltas = fog_deltas(net, net.blocks, batches, call=lambda m, b: m(*b))
    fog = select_layers(deltas, cfg.k)
    stored = store_profile(net, batches, torch.cat(teachers))
    ctx.log(f"seed {cfg.seed}: FoG-A delta {np.round(deltas, 3).tolist()} -> layers {list(fog.layers)} "
            f"weights {np.round(fog.weights, 3).tolist()}; probe R2 {np.round(stored, 3).tolist()}")

    test, test_c, _ = task.sample(cfg.test, torch.Generator().manual_seed(cfg.seed * 1000 + 3))
    start = copy.deepcopy(net.state_dict())
    metrics: dict[str, dict[str, float]] = {}
    for arm in cfg.arms:
        layers, weights = arm_layers(arm, cfg, fog)
        net.load_state_dict(start)
        _train(net, task, cfg, cfg.steps, layers, weights, seed=cfg.seed * 1000 + 4)  # same batches for every arm
        x, c = generate(net, cfg, torch.Generator().manual_seed(cfg.seed * 1000 + 5))
        per_class = [_fd(x[c == k], test[test_c == k]) for k in range(cfg.classes)]
        metrics[arm] = {"fd": _fd(x, test), "fd_class": float(np.mean(per_class))}
        ctx.note(f"seed {cfg.seed} {arm} layers {list(layers)}: {metrics[arm]}")
    return {"seed": cfg.seed, "metrics": metrics,
            "curves": {"layers": {"x": list(range(cfg.depth)),
                                  "arms": {"FoG-A delta (contribute)": [float(d) for d in deltas],
                                           "teacher probe R2 (store)": stored}}},
            "info": {"fog_layers": list(fog.layers), "fog_weights": list(fog.weights),
                     "arm_layers": {a: list(arm_layers(a, cfg, fog)[0]) for a in cfg.arms}},
            "cpu_s": time.process_time() - cpu0}


SEED = StageKind(Seed, _run, "one replicate: data, phase 1, FoG-A probe, every arm's phase 2 and FD")
