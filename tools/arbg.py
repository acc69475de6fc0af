"""Autoregressive Boltzmann Generators (ArBG): a discretised autoregressive proposal with exact
likelihoods, self-normalised importance sampling (SNIS), ESS and the energy Wasserstein-2.

Rehman, Tan, Bengio, Bose, Tong, "Autoregressive Boltzmann Generators" (ICML 2026, arXiv
2606.27361); reference code danyalrehman/AutoBG (MIT core). Independent torch implementation
(research/papers.md §19); the AutoBG files read were ``discretize.py``, ``autoregressive_module.py``
(``compute_log_likelihood``), ``ess.py`` and ``distribution_distances.py``.

Why: a Boltzmann generator is only useful if its proposal density q(x) is exact, so samples
can be reweighted to the target p(x) ∝ exp(−E(x)). A categorical autoregressive model over
discretised coordinates gives q exactly in one forward pass:

    log P(b) = Σ_j log softmax(filter(logits_j(b_<j) / T))[b_j]          (bins b_j ∈ {0..B−1})
    log q(x) = log P(bins(x)) − Σ_j log w_j      (uniform within-bin noise, bin width w_j)
    log w̃_i = −E(x_i) − log q(x_i);   w_i = exp(log w̃_i) / Σ_k exp(log w̃_k)     (SNIS)
    ESS = (Σ w̃)² / Σ w̃²  (Kish);   E-W2 = W2(E(x_true), E(x_pred)) in 1-D (optionally weighted)

``filter`` is temperature T then nucleus (top-p) filtering exactly as AutoBG applies it: keep
the smallest prefix of bins (sorted by probability) whose cumulative mass reaches p, always
keeping the top bin. The same ``filter_logits`` runs in sampling and in the likelihood, so the
likelihood of a sample is that of the distribution it was drawn from (the sampler's running
log-prob equals the one-pass value; tested).

Deliberate differences from AutoBG (documented, not options): bins are the B equal cells of
[low, high] (index ⌊(x − low)/w⌋, centre low + (i + ½)w); AutoBG rounds onto B points spaced
(high − low)/(B − 1) but adds noise of width (high − low)/B. A point outside the box has
log q = −inf here (AutoBG clips it into the edge bins). Within-bin noise is uniform (AutoBG
also offers empirical offsets).

Shapes: coordinates x (N, D); bins (N, D) int64; energies, log q and weights (N,).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated, Callable, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import nn

from closedloop.artifacts import ArrayInput, ArrayRef, array_output, load_array, write_artifact
from closedloop.tool import ArgumentLimits, Tool, tool

__all__ = [
    "Discretizer", "filter_logits", "ARModel", "sequence_log_prob", "sample", "log_q", "train_mle",
    "ToyEnergy", "toy_energy", "grid_sample", "snis_log_weights", "snis_weights", "ess", "ess_from_weights",
    "wasserstein2_1d", "energy_w2", "ToyRun", "run_toy", "TOOLS",
]


# ---------------------------------------------------------------------------------- discretisation


@dataclass(frozen=True)
class Discretizer:
    """B equal bins per coordinate over the box [low_j, high_j]."""

    low: torch.Tensor  # (D,)
    high: torch.Tensor  # (D,)
    num_bins: int = 256

    def __post_init__(self) -> None:
        if self.num_bins < 2:
            raise ValueError(f"num_bins must be ≥ 2, got {self.num_bins}")
        if self.low.shape != self.high.shape or self.low.ndim != 1:
            raise ValueError(f"low and high must be 1-D of the same length, got {tuple(self.low.shape)}, {tuple(self.high.shape)}")
        if not torch.all(self.high > self.low):
            raise ValueError("every high must exceed its low")

    @classmethod
    def box(cls, low: float | list[float], high: float | list[float], dim: int, num_bins: int = 256) -> Discretizer:
        lo = torch.as_tensor(low, dtype=torch.float64).expand(dim).clone()
        hi = torch.as_tensor(high, dtype=torch.float64).expand(dim).clone()
        return cls(lo, hi, num_bins)

    @property
    def dim(self) -> int:
        return self.low.shape[0]

    @property
    def width(self) -> torch.Tensor:
        return (self.high - self.low) / self.num_bins

    @property
    def log_volume(self) -> float:
        """Σ_j log w_j: log q(x) = log P(bins) − log_volume."""
        return float(torch.log(self.width).sum())

    def inside(self, x: torch.Tensor) -> torch.Tensor:
        return ((x >= self.low) & (x < self.high)).all(-1)

    def to_bins(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"x must have shape (N, {self.dim}), got {tuple(x.shape)}")
        idx = torch.floor((x.double() - self.low) / self.width).long()
        return idx.clamp(0, self.num_bins - 1)

    def centres(self, bins: torch.Tensor) -> torch.Tensor:
        return self.low + (bins.double() + 0.5) * self.width

    def from_bins(self, bins: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Un-discretise with uniform within-bin noise: x = low + (b + u) w, u ~ U[0, 1)."""
        u = torch.rand(bins.shape, generator=generator, dtype=torch.float64)
        return self.low + (bins.double() + u) * self.width


# ---------------------------------------------------------------------------------- model


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_p: float | None = None) -> torch.Tensor:
    """Temperature then nucleus filtering over the last axis (AutoBG's rule); removed bins get −inf."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    scaled = logits / temperature
    if top_p is None or top_p >= 1:
        return scaled
    sorted_logits, order = torch.sort(scaled, descending=True, dim=-1)
    cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cum > top_p
    remove[..., 1:] = remove[..., :-1].clone()  # keep the bin that crosses p
    remove[..., 0] = False
    remove = remove.scatter(-1, order, remove)
    return scaled.masked_fill(remove, float("-inf"))


class ARModel(nn.Module):
    """A small GPT-style causal transformer over D bin tokens (pre-norm, no dropout).

    Input: a start token then b_0 … b_{D−2}; output at position j: logits of b_j given b_<j.
    One pass therefore yields every conditional, hence the exact joint.
    """

    def __init__(self, dim: int, num_bins: int = 256, d_model: int = 64, n_layers: int = 1, n_heads: int = 4) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"dim must be ≥ 1, got {dim}")
        self.dim, self.num_bins = dim, num_bins
        self.tok = nn.Embedding(num_bins + 1, d_model)  # index num_bins = start token
        self.pos = nn.Parameter(torch.zeros(dim, d_model))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_bins)

    def forward(self, prefix: torch.Tensor) -> torch.Tensor:
        """prefix (N, L) bins with 0 ≤ L ≤ D − 1 → logits (N, L + 1, B) for b_0 … b_L."""
        n, length = prefix.shape
        if length > self.dim - 1:
            raise ValueError(f"prefix has {length} tokens; at most {self.dim - 1} for dim {self.dim}")
        start = torch.full((n, 1), self.num_bins, dtype=torch.long, device=prefix.device)
        tokens = torch.cat([start, prefix], 1)
        h = self.tok(tokens) + self.pos[: length + 1]
        mask = nn.Transformer.generate_square_subsequent_mask(length + 1, dtype=h.dtype)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def sequence_log_prob(model: ARModel, bins: torch.Tensor, temperature: float = 1.0, top_p: float | None = None,
                      per_coordinate: bool = False) -> torch.Tensor:
    """Exact log P(bins) in one forward pass: Σ_j log softmax(filter(logits_j))[b_j]."""
    if bins.ndim != 2 or bins.shape[1] != model.dim:
        raise ValueError(f"bins must have shape (N, {model.dim}), got {tuple(bins.shape)}")
    if bins.numel() and (int(bins.min()) < 0 or int(bins.max()) >= model.num_bins):
        raise ValueError(f"bins must lie in [0, {model.num_bins})")
    logits = model(bins[:, :-1])
    logp = F.log_softmax(filter_logits(logits, temperature, top_p), -1)
    per = logp.gather(-1, bins.unsqueeze(-1)).squeeze(-1)
    return per if per_coordinate else per.sum(-1)


@torch.no_grad()
def sample(model: ARModel, n: int, temperature: float = 1.0, top_p: float | None = None,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw n bin sequences token by token; returns (bins (n, D), running log P (n,))."""
    bins = torch.empty(n, 0, dtype=torch.long)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(model.dim):
        logp = F.log_softmax(filter_logits(model(bins)[:, -1], temperature, top_p), -1)
        b = torch.multinomial(logp.exp(), 1, generator=generator)
        total += logp.gather(-1, b).squeeze(-1).double()
        bins = torch.cat([bins, b], 1)
    return bins, total


def log_q(model: ARModel, disc: Discretizer, x: torch.Tensor, temperature: float = 1.0,
          top_p: float | None = None) -> torch.Tensor:
    """Continuous log q(x) = log P(bins(x)) − Σ log w_j; −inf outside the box."""
    with torch.no_grad():
        lp = sequence_log_prob(model, disc.to_bins(x), temperature, top_p).double() - disc.log_volume
    return torch.where(disc.inside(x), lp, torch.full_like(lp, float("-inf")))


def train_mle(model: ARModel, bins: torch.Tensor, *, steps: int = 200, batch: int = 256, lr: float = 3e-3,
              seed: int = 0, progress: bool = False) -> list[float]:
    """Maximum likelihood on bin sequences with Adam; returns the per-step mean NLL (nats, discrete)."""
    if bins.shape[0] == 0:
        raise ValueError("no training data")
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    losses: list[float] = []
    ctx = None
    if progress:
        from rich.progress import Progress

        ctx = Progress(transient=True)
        task = ctx.add_task("ArBG MLE", total=steps)
        ctx.start()
    try:
        model.train()
        for _ in range(steps):
            idx = torch.randint(0, bins.shape[0], (min(batch, bins.shape[0]),), generator=g)
            loss = -sequence_log_prob(model, bins[idx]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            if ctx is not None:
                ctx.update(task, advance=1, description=f"ArBG MLE nll={losses[-1]:.3f}")
    finally:
        model.eval()
        if ctx is not None:
            ctx.stop()
    return losses


# ---------------------------------------------------------------------------------- toy energies


@dataclass(frozen=True)
class ToyEnergy:
    """A small energy with a box that holds (almost) all of its mass."""

    name: str
    dim: int
    low: float
    high: float
    energy: Callable[[torch.Tensor], torch.Tensor]  # (N, D) float64 → (N,)


def _gmm_energy(x: torch.Tensor) -> torch.Tensor:
    # Four equal Gaussians on a ring of radius 2.5, σ = 0.4: E = −log p (normalised, log Z = 0).
    ang = torch.arange(4, dtype=torch.float64) * (math.pi / 2) + math.pi / 4
    mu = 2.5 * torch.stack([ang.cos(), ang.sin()], 1)
    s2 = 0.4 ** 2
    d2 = ((x.double()[:, None, :] - mu) ** 2).sum(-1)
    return -(torch.logsumexp(-d2 / (2 * s2), 1) - math.log(4) - math.log(2 * math.pi * s2))


def _double_well_2d(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return 3.0 * (x[:, 0] ** 2 - 1) ** 2 + 0.5 * x[:, 1] ** 2


def _double_well_1d(x: torch.Tensor) -> torch.Tensor:
    return 3.0 * (x.double()[:, 0] ** 2 - 1) ** 2


_TOYS = {
    "gmm": ToyEnergy("gmm", 2, -4.5, 4.5, _gmm_energy),
    "double_well": ToyEnergy("double_well", 2, -4.0, 4.0, _double_well_2d),
    "double_well_1d": ToyEnergy("double_well_1d", 1, -2.5, 2.5, _double_well_1d),
}
ToyName = Literal["gmm", "double_well", "double_well_1d"]


def toy_energy(name: str) -> ToyEnergy:
    if name not in _TOYS:
        raise ValueError(f"unknown toy energy {name!r}; choose from {sorted(_TOYS)}")
    return _TOYS[name]


def grid_sample(toy: ToyEnergy, n: int, *, resolution: int | None = None, seed: int = 0) -> torch.Tensor:
    """Near-exact samples of exp(−E) on the box: pick a fine cell ∝ exp(−E(centre)), jitter uniformly."""
    if toy.dim > 2:
        raise ValueError("grid_sample enumerates the box, so dim must be ≤ 2")
    res = resolution or (1024 if toy.dim == 2 else 65536)
    w = (toy.high - toy.low) / res
    c = toy.low + (torch.arange(res, dtype=torch.float64) + 0.5) * w
    pts = torch.cartesian_prod(*([c] * toy.dim)).reshape(-1, toy.dim)
    logits = -toy.energy(pts)
    g = torch.Generator().manual_seed(seed)
    idx = torch.multinomial(torch.softmax(logits, 0), n, replacement=True, generator=g)
    return pts[idx] + (torch.rand(n, toy.dim, generator=g, dtype=torch.float64) - 0.5) * w


# ---------------------------------------------------------------------------------- SNIS, ESS, E-W2


def snis_log_weights(energy: torch.Tensor, log_q_x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """Unnormalised log weights −βE(x) − log q(x)."""
    if energy.shape != log_q_x.shape:
        raise ValueError(f"energy {tuple(energy.shape)} and log q {tuple(log_q_x.shape)} must match")
    return -beta * energy - log_q_x


def snis_weights(log_w: torch.Tensor) -> torch.Tensor:
    """Self-normalised weights exp(log w) / Σ exp(log w), stable for any constant shift."""
    if log_w.ndim != 1 or log_w.numel() == 0:
        raise ValueError(f"log weights must be a non-empty vector, got shape {tuple(log_w.shape)}")
    if torch.isnan(log_w).any() or torch.isposinf(log_w).any():
        raise ValueError("log weights contain NaN or +inf")
    if torch.isneginf(log_w).all():
        raise ValueError("every log weight is −inf (no sample has support under the target and proposal)")
    return torch.softmax(log_w, 0)


def ess(log_w: torch.Tensor) -> float:
    """Kish ESS from log weights: exp(2 logsumexp(log w) − logsumexp(2 log w))."""
    snis_weights(log_w)  # same validation
    return float(torch.exp(2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0)))


def ess_from_weights(w: torch.Tensor) -> float:
    """Kish ESS (Σw)² / Σw² from non-negative (unnormalised) weights."""
    if (w < 0).any() or not torch.isfinite(w).all() or float(w.sum()) <= 0:
        raise ValueError("weights must be finite, non-negative and not all zero")
    return float(w.sum() ** 2 / (w ** 2).sum())


def wasserstein2_1d(a: np.ndarray, b: np.ndarray, wa: np.ndarray | None = None, wb: np.ndarray | None = None) -> float:
    """Exact W2 between two weighted 1-D empirical laws: sqrt(∫₀¹ (F_a⁻¹(u) − F_b⁻¹(u))² du)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a.size == 0 or b.size == 0:
        raise ValueError("both samples must be non-empty")

    def prep(x: np.ndarray, w: np.ndarray | None, name: str) -> tuple[np.ndarray, np.ndarray]:
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{name} holds NaN or infinite values")
        w = np.full(x.size, 1.0) if w is None else np.asarray(w, np.float64).ravel()
        if w.shape != x.shape:
            raise ValueError(f"{name}: {w.size} weights for {x.size} values")
        if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"{name}: weights must be finite, non-negative and not all zero")
        order = np.argsort(x, kind="stable")
        cdf = np.cumsum(w[order])
        return x[order], cdf / cdf[-1]

    xa, ca = prep(a, wa, "first sample")
    xb, cb = prep(b, wb, "second sample")
    u = np.sort(np.concatenate([[0.0], ca, cb]))  # repeated breakpoints give du = 0: harmless
    du = np.diff(u)
    mid = (u[:-1] + u[1:]) / 2
    qa = xa[np.minimum(np.searchsorted(ca, mid, side="left"), xa.size - 1)]
    qb = xb[np.minimum(np.searchsorted(cb, mid, side="left"), xb.size - 1)]
    return float(math.sqrt(max(0.0, float(np.sum(du * (qa - qb) ** 2)))))


def energy_w2(e_true: np.ndarray, e_pred: np.ndarray, weights_pred: np.ndarray | None = None) -> float:
    """E-W2: 1-D W2 between target energies and (optionally SNIS-reweighted) proposal energies."""
    return wasserstein2_1d(e_true, e_pred, None, weights_pred)


# ---------------------------------------------------------------------------------- toy run


@dataclass
class ToyRun:
    model: ARModel
    disc: Discretizer
    losses: list[float]
    samples: torch.Tensor
    log_q: torch.Tensor
    energy: torch.Tensor
    log_w: torch.Tensor
    reference: torch.Tensor  # exact (grid) samples of the target
    train_s: float


def run_toy(name: str = "gmm", *, num_bins: int = 256, n_train: int = 20000, steps: int = 200,
            n_samples: int = 5000, temperature: float = 1.0, top_p: float | None = None, seed: int = 0,
            d_model: int = 64, progress: bool = False) -> ToyRun:
    """Train an ArBG on exact samples of a toy energy, sample it and reweight the samples."""
    toy = toy_energy(name)
    torch.manual_seed(seed)
    disc = Discretizer.box(toy.low, toy.high, toy.dim, num_bins)
    data = grid_sample(toy, n_train, seed=seed)
    model = ARModel(toy.dim, num_bins, d_model=d_model)
    t0 = time.perf_counter()
    losses = train_mle(model, disc.to_bins(data), steps=steps, seed=seed, progress=progress)
    train_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(seed + 1)
    bins, run_lp = sample(model, n_samples, temperature, top_p, generator=g)
    x = disc.from_bins(bins, generator=g)
    lq = run_lp - disc.log_volume
    e = toy.energy(x)
    return ToyRun(model, disc, losses, x, lq, e, snis_log_weights(e, lq), grid_sample(toy, n_samples, seed=seed + 2),
                  train_s)


# ---------------------------------------------------------------------------------- tools


class ToyReport(BaseModel):
    energy: str
    dim: int
    num_bins: int
    steps: int
    train_seconds: float
    final_train_nll: float = Field(description="mean discrete NLL (nats) over the last 10 steps")
    heldout_log_q: float = Field(description="mean continuous log q on fresh exact target samples")
    ess: float
    ess_fraction: float
    e_w2_raw: float = Field(description="E-W2 of the unweighted proposal samples")
    e_w2_reweighted: float = Field(description="E-W2 after SNIS reweighting")
    samples: ArrayRef | None = Field(None, description=".npz with x, log_q, energy, weights (save_samples)")


Count = Annotated[int, Field(ge=1, le=200_000)]


@tool(timeout_s=600, isolation="process")
def arbg_toy(energy: ToyName = "gmm", num_bins: Annotated[int, Field(ge=2, le=1024)] = 256,
             n_train: Count = 20000, steps: Annotated[int, Field(ge=1, le=20000)] = 200, n_samples: Count = 5000,
             temperature: Annotated[float, Field(gt=0.0)] = 1.0,
             top_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None, seed: int = 0,
             save_samples: bool = False) -> ToyReport:
    """Train a discretised autoregressive Boltzmann generator on a toy energy, sample, reweight, score.

    Reports the exact held-out likelihood, the Kish ESS of the SNIS weights and E-W2 (1-D
    Wasserstein-2 between target and proposal energies) before and after reweighting.

    Args:
        energy: 'gmm' (4 Gaussians on a ring, 2-D), 'double_well' (2-D) or 'double_well_1d'.
        num_bins: Bins per coordinate (the paper uses 256).
        n_train: Exact target samples to train on (drawn on a fine grid).
        steps: Adam steps of maximum likelihood.
        n_samples: Proposal samples to draw and reweight.
        temperature: Sampling temperature; the likelihood uses the same one.
        top_p: Nucleus threshold, or null for none; the likelihood uses the same one.
        seed: Seed for data, initialisation and sampling.
        save_samples: Also save x, log_q, energy and weights as an .npz artifact.
    """
    run = run_toy(energy, num_bins=num_bins, n_train=n_train, steps=steps, n_samples=n_samples,
                  temperature=temperature, top_p=top_p, seed=seed)
    toy = toy_energy(energy)
    held = grid_sample(toy, 2000, seed=seed + 3)
    lq_held = log_q(run.model, run.disc, held, temperature, top_p)
    finite = torch.isfinite(lq_held)
    w = snis_weights(run.log_w)
    ref_e = toy.energy(run.reference).numpy()
    ref: ArrayRef | None = None
    if save_samples:
        x, lq, en, wt = run.samples.numpy(), run.log_q.numpy(), run.energy.numpy(), w.numpy()
        reserve = sum(a.nbytes for a in (x, lq, en, wt)) + 2**16  # uncompressed .npz: headers and zip records
        path = write_artifact("arbg-samples", ".npz", lambda f: np.savez(f, x=x, log_q=lq, energy=en, weights=wt),
                              reserve_bytes=reserve)
        ref = ArrayRef(path=str(path), shape=list(run.samples.shape), dtype="float64", key="x")
    n_ess = ess(run.log_w)
    return ToyReport(
        energy=energy, dim=toy.dim, num_bins=num_bins, steps=steps, train_seconds=run.train_s,
        final_train_nll=float(np.mean(run.losses[-10:])),
        heldout_log_q=float(lq_held[finite].mean()) if finite.any() else float("-inf"),
        ess=n_ess, ess_fraction=n_ess / n_samples,
        e_w2_raw=energy_w2(ref_e, run.energy.numpy()),
        e_w2_reweighted=energy_w2(ref_e, run.energy.numpy(), w.numpy()), samples=ref)


def _vector(value: ArrayInput, name: str, allow_neg_inf: bool = False) -> np.ndarray:
    arr = np.asarray(load_array(value, name=name, require_finite=not allow_neg_inf), dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {arr.shape}")
    if np.isnan(arr).any() or np.isposinf(arr).any():
        raise ValueError(f"{name} contains NaN or +inf")
    return arr


class SnisReport(BaseModel):
    n: int
    ess: float
    ess_fraction: float
    max_weight: float
    weights: ArrayRef | list = Field(description="self-normalised weights, inline if small else an .npy artifact")


@tool(limits=ArgumentLimits(allow_non_finite=True))  # −inf in log_q marks a sample outside the support
def arbg_snis(energies: ArrayInput, log_q: ArrayInput, beta: Annotated[float, Field(gt=0.0)] = 1.0) -> SnisReport:
    """Self-normalised importance weights w ∝ exp(−βE(x) − log q(x)) and their Kish ESS.

    Args:
        energies: Target energies E(x_i), shape (N,): .npy/.npz/.safetensors path or inline list.
        log_q: Proposal log-densities log q(x_i), shape (N,); −inf marks a sample outside the support.
        beta: Inverse temperature of the target.
    """
    e = _vector(energies, "energies")
    lq = _vector(log_q, "log_q", allow_neg_inf=True)
    if e.shape != lq.shape:
        raise ValueError(f"energies {e.shape} and log_q {lq.shape} must have the same length")
    lw = snis_log_weights(torch.from_numpy(e), torch.from_numpy(lq).clone(), beta)
    lw = torch.where(torch.isneginf(torch.from_numpy(lq)), torch.full_like(lw, float("-inf")), lw)
    w = snis_weights(lw)
    n_ess = ess(lw)
    return SnisReport(n=e.size, ess=n_ess, ess_fraction=n_ess / e.size, max_weight=float(w.max()),
                      weights=array_output(w.numpy(), prefix="snis-weights"))


class EW2Report(BaseModel):
    e_w2: float
    mean_true: float
    mean_pred: float = Field(description="(weighted) mean of the predicted energies")


@tool
def arbg_energy_w2(energies_true: ArrayInput, energies_pred: ArrayInput,
                   weights_pred: ArrayInput | None = None) -> EW2Report:
    """E-W2: the 1-D Wasserstein-2 distance between target and generated energy distributions.

    Args:
        energies_true: Energies of reference target samples, shape (N,).
        energies_pred: Energies of generated samples, shape (M,).
        weights_pred: Optional non-negative weights of the generated samples (e.g. SNIS), shape (M,).
    """
    et, ep = _vector(energies_true, "energies_true"), _vector(energies_pred, "energies_pred")
    wp = None if weights_pred is None else _vector(weights_pred, "weights_pred")
    if wp is not None and wp.shape != ep.shape:
        raise ValueError(f"weights_pred has {wp.size} entries for {ep.size} energies")
    d = energy_w2(et, ep, wp)
    mp = float(np.average(ep, weights=wp)) if wp is not None else float(ep.mean())
    return EW2Report(e_w2=d, mean_true=float(et.mean()), mean_pred=mp)


TOOLS: list[Tool] = [arbg_toy, arbg_snis, arbg_energy_w2]
