"""Predictive-coding networks (PCNs) and their convergence to backprop at large width.

Innocenti, Achour, Bogacz et al., "Infinite width and depth limits of predictive coding
networks", ICML 2026 (arXiv 2602.07697); μPC from Innocenti et al. 2025 (arXiv 2505.13124);
reference code thebuckleylab/jpc (MIT), ``experiments/limits_paper``. Nothing is copied from it.

Energy of a batch of B samples, activities z_1..z_{L-1} free, z_0 = x and z_L = y clamped::

    F(z) = (1/B) Σ_i [ Σ_{ℓ<L} ½‖z_ℓ − f_ℓ(z_{ℓ−1})‖² + (λ/2)‖y − f_L(z_{L−1})‖² ]
    f_1(x) = a_1 W_1 x,   f_ℓ(z) = a_ℓ W_ℓ φ(z) [+ z if residual],   f_L(z) = a_L W_L φ(z)

For a linear net (φ = id) write A_ℓ for the map of layer ℓ (a_ℓ W_ℓ, plus I on a residual
hidden layer) and P_ℓ = A_L ⋯ A_{ℓ+1} for the map from layer ℓ's error to the output. The
energy at the activity equilibrium is then a rescaled squared error (min-norm errors
e_ℓ = P_ℓᵀ S⁻¹ r solve min ½Σ‖e_ℓ‖² subject to Σ_ℓ P_ℓ e_ℓ = r)::

    F* = (1/2B) Σ_i r_iᵀ S⁻¹ r_i,   r_i = y_i − A_{L:1} x_i,   S = I/λ + Σ_{ℓ=1}^{L−1} P_ℓ P_ℓᵀ

and the BP loss it is compared to is ℒ = (λ/2B) Σ_i ‖r_i‖². F*/ℒ → 1 exactly when
Σ P_ℓP_ℓᵀ ≪ I/λ, which μPC achieves when width N ≫ depth L (each P_ℓP_ℓᵀ is O(1/N)); then
PC's local weight gradients (−∂F/∂W at equilibrium, by the envelope theorem = ∇_W F*)
equal BP's. Under SP, Σ P_ℓP_ℓᵀ grows with depth, so F* ≪ ℒ at any width; under NTP the
output scale 1/√N keeps each P_ℓP_ℓᵀ O(1), so F*/ℒ stays O(1/L) however wide the net
(gradient directions still align as N grows).

Parameterisations (N width, D input dim, L depth = number of weight matrices):

* ``sp``: a_ℓ = 1, W ~ N(0, 1/fan_in).
* ``ntp``: W ~ N(0, 1); a_1 = 1/√D, hidden a_ℓ = 1/√N (1/√(NL) with skips), a_L = 1/√N.
* ``mupc``: as ``ntp`` but a_L = 1/N (the depth-μP-style output scaling).

Shapes: x (B, D), y (B, O), hidden activities (B, N) each, W_1 (N, D), W_ℓ (N, N), W_L (O, N).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, Field

from closedloop.artifacts import ArrayInput, load_array
from closedloop.tool import Tool, tool

__all__ = [
    "PCNetwork", "InferenceResult", "Alignment", "layer_scalings", "init_network", "activity_grads", "infer",
    "linear_equilibrium", "pc_weight_grads", "bp_weight_grads", "pc_update", "compare_pc_bp", "TOOLS",
]

ParamType = Literal["sp", "ntp", "mupc"]
Activation = Literal["linear", "tanh", "relu"]
_ACTS = {"linear": lambda z: z, "tanh": torch.tanh, "relu": torch.relu}
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def layer_scalings(param_type: ParamType, input_dim: int, width: int, depth: int, residual: bool) -> list[float]:
    """Per-layer multipliers a_ℓ; the hidden one shrinks with depth only when skips add up."""
    if param_type not in ("sp", "ntp", "mupc"):
        raise ValueError(f"param_type must be 'sp', 'ntp' or 'mupc', got {param_type!r}")
    if param_type == "sp":
        return [1.0] * depth
    a1 = 1.0 / math.sqrt(input_dim)
    ah = 1.0 / math.sqrt(width * depth) if residual else 1.0 / math.sqrt(width)
    aL = 1.0 / width if param_type == "mupc" else 1.0 / math.sqrt(width)
    return [a1] + [ah] * (depth - 2) + [aL]


@dataclass
class PCNetwork:
    """A fully connected PCN; weights are plain tensors so updates stay explicit and local."""

    weights: list[torch.Tensor]
    scales: list[float]
    residual: bool
    activation: str = "linear"
    output_weight: float = 1.0  # λ, the precision of the output error

    @property
    def depth(self) -> int:
        return len(self.weights)

    def phi(self, z: torch.Tensor) -> torch.Tensor:
        return _ACTS[self.activation](z)

    def predict(self, layer: int, z_prev: torch.Tensor) -> torch.Tensor:
        """f_ℓ(z_{ℓ−1}) for 0-based ``layer``: no nonlinearity on the input, skips on hidden layers."""
        inp = z_prev if layer == 0 else self.phi(z_prev)
        out = self.scales[layer] * inp @ self.weights[layer].T
        if self.residual and 0 < layer < self.depth - 1:
            out = out + z_prev
        return out

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Feedforward activities [z_1, ..., z_{L−1}, output]: PC's usual starting point."""
        zs, z = [], x
        for layer in range(self.depth):
            z = self.predict(layer, z)
            zs.append(z)
        return zs

    def errors(self, hidden: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """ε_ℓ = z_ℓ − f_ℓ(z_{ℓ−1}) for every layer, the output one against the clamped target."""
        zs = [x, *hidden, y]
        return [zs[l + 1] - self.predict(l, zs[l]) for l in range(self.depth)]

    def energy(self, hidden: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        errs = self.errors(hidden, x, y)
        total = sum(0.5 * (e ** 2).sum() for e in errs[:-1]) + 0.5 * self.output_weight * (errs[-1] ** 2).sum()
        return total / x.shape[0]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """BP's quadratic loss (λ/2B)Σ‖y − f(x)‖², the quantity F* should converge to."""
        return 0.5 * self.output_weight * ((y - self.forward(x)[-1]) ** 2).sum() / x.shape[0]


def init_network(input_dim: int, width: int, depth: int, output_dim: int, *, param_type: ParamType = "mupc",
                 residual: bool = True, activation: str = "linear", output_weight: float = 1.0, seed: int = 0,
                 dtype: torch.dtype = torch.float64) -> PCNetwork:
    """Draw weights for one parameterisation; SP keeps its scale in W, NTP/μPC in a_ℓ."""
    if min(input_dim, width, output_dim) < 1:
        raise ValueError("input_dim, width and output_dim must be positive")
    if depth < 2:
        raise ValueError(f"depth must be at least 2 (one hidden layer), got {depth}")
    if activation not in _ACTS:
        raise ValueError(f"activation must be one of {sorted(_ACTS)}, got {activation!r}")
    if not (output_weight > 0 and math.isfinite(output_weight)):
        raise ValueError(f"output_weight must be positive and finite, got {output_weight}")
    gen = torch.Generator().manual_seed(seed)
    dims = [input_dim] + [width] * (depth - 1) + [output_dim]
    weights = []
    for fan_in, fan_out in zip(dims[:-1], dims[1:]):
        w = torch.randn(fan_out, fan_in, generator=gen, dtype=torch.float64)
        if param_type == "sp":
            w = w / math.sqrt(fan_in)
        weights.append(w.to(dtype))
    return PCNetwork(weights, layer_scalings(param_type, input_dim, width, depth, residual), residual,
                     activation, output_weight)


# ---------------------------------------------------------------------------------- inference


@dataclass
class InferenceResult:
    hidden: list[torch.Tensor]
    energy: float
    steps: int
    grad_max: float  # max |∂F_i/∂z| over samples and units at the end
    converged: bool
    step_size: float


def activity_grads(net: PCNetwork, hidden: list[torch.Tensor], x: torch.Tensor,
                   y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Energy and per-sample ∂F_i/∂z_ℓ = ε_ℓ − J_{ℓ+1}ᵀ ε_{ℓ+1}, in closed form (no autograd).

    Each layer's gradient needs only its own error and the error of the layer above: the
    locality that makes PC inference biologically plausible, and fast here.
    """
    with torch.no_grad():
        errs = net.errors(hidden, x, y)
        energy = (sum(0.5 * (e ** 2).sum() for e in errs[:-1])
                  + 0.5 * net.output_weight * (errs[-1] ** 2).sum()) / x.shape[0]
        grads = []
        for l, z in enumerate(hidden):  # hidden layer l feeds weight layer l + 1
            up = errs[l + 1] * (net.output_weight if l + 1 == net.depth - 1 else 1.0)
            back = net.scales[l + 1] * (up @ net.weights[l + 1]) * _dphi(net.activation, z)
            if net.residual and l + 1 < net.depth - 1:
                back = back + up
            grads.append(errs[l] - back)
    return energy, grads


def _dphi(activation: str, z: torch.Tensor) -> torch.Tensor | float:
    if activation == "tanh":
        return 1 - torch.tanh(z) ** 2
    if activation == "relu":
        return (z > 0).to(z.dtype)
    return 1.0


def _max_curvature(net: PCNetwork, hidden: list[torch.Tensor], x, y, iters: int = 40) -> float:
    """Largest eigenvalue of the activity Hessian (power iteration on Hessian-vector products)."""
    gen = torch.Generator().manual_seed(1234)
    v = [torch.randn(h.shape, generator=gen, dtype=h.dtype) for h in hidden]
    zs = [h.detach().requires_grad_(True) for h in hidden]
    grads = torch.autograd.grad(net.energy(zs, x, y) * x.shape[0], zs, create_graph=True)
    lam = 1.0
    for _ in range(iters):
        norm = torch.sqrt(sum(((t ** 2).sum() for t in v), v[0].new_zeros(())))
        v = [t / norm for t in v]
        hv = torch.autograd.grad(grads, zs, grad_outputs=v, retain_graph=True)
        lam = float(sum((a * b).sum() for a, b in zip(hv, v)))
        v = [t.detach() for t in hv]
    return max(lam, 1e-12)


def infer(net: PCNetwork, x: torch.Tensor, y: torch.Tensor, *, max_steps: int = 20000, tol: float = 1e-10,
          step_size: float | None = None, init: list[torch.Tensor] | None = None) -> InferenceResult:
    """Gradient descent on the activities with x and y clamped, from the feedforward pass.

    The default step is 1/λ_max of the activity Hessian (stable for any quadratic energy);
    a step that raises the energy is undone and halved, which keeps nonlinear nets stable.
    Stops when every per-sample activity gradient is below ``tol``.
    """
    _check_xy(net, x, y)
    with torch.no_grad():
        hidden = [h.clone() for h in (init or net.forward(x)[:-1])]
    if step_size is None:
        step_size = 1.0 / _max_curvature(net, hidden, x, y)
    if not step_size > 0:
        raise ValueError(f"step_size must be positive, got {step_size}")
    zs = hidden
    rise_tol = 100 * torch.finfo(x.dtype).eps
    e, grads = activity_grads(net, zs, x, y)
    gmax, steps = _gmax(grads), 0
    while steps < max_steps and gmax > tol:
        tz = [z - step_size * g for z, g in zip(zs, grads)]
        te, tg = activity_grads(net, tz, x, y)
        steps += 1
        if float(te) > float(e) * (1 + rise_tol) and step_size > 1e-12:  # a rounding-level rise is no rise
            step_size *= 0.5
            continue
        zs, e, grads, gmax = tz, te, tg, _gmax(tg)
    if not math.isfinite(float(e)):
        raise FloatingPointError("inference diverged (non-finite energy); lower step_size")
    return InferenceResult([z.detach() for z in zs], float(e), steps, gmax, gmax <= tol, step_size)


def _gmax(grads) -> float:
    return max(float(g.abs().max()) for g in grads)


def _check_xy(net: PCNetwork, x: torch.Tensor, y: torch.Tensor) -> None:
    d_in, d_out = net.weights[0].shape[1], net.weights[-1].shape[0]
    if x.ndim != 2 or x.shape[1] != d_in:
        raise ValueError(f"inputs must have shape (B, {d_in}), got {tuple(x.shape)}")
    if y.ndim != 2 or y.shape != (x.shape[0], d_out):
        raise ValueError(f"targets must have shape ({x.shape[0]}, {d_out}), got {tuple(y.shape)}")


# ---------------------------------------------------------------------------------- theory


def _layer_maps(net: PCNetwork) -> list[torch.Tensor]:
    """A_ℓ, the linear map of each layer (only meaningful when φ is the identity)."""
    maps = []
    for l, (a, w) in enumerate(zip(net.scales, net.weights)):
        m = a * w
        if net.residual and 0 < l < net.depth - 1:
            m = m + torch.eye(w.shape[0], dtype=w.dtype)
        maps.append(m)
    return maps


def linear_equilibrium(net: PCNetwork, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    """Closed-form F* and the equilibrium activities of a linear PCN (no inference run)."""
    if net.activation != "linear":
        raise ValueError("the closed-form equilibrium holds for linear networks only; use inference")
    _check_xy(net, x, y)
    maps = _layer_maps(net)
    d_out = maps[-1].shape[0]
    partial = [torch.eye(d_out, dtype=x.dtype)]  # P_{L-1} = A_L, ..., P_1 = A_L ⋯ A_2
    for m in reversed(maps[1:]):
        partial.append(partial[-1] @ m)
    partial = partial[1:][::-1]  # partial[l] = P_{l+1} (0-based hidden layer l)
    S = torch.eye(d_out, dtype=x.dtype) / net.output_weight + sum(p @ p.T for p in partial)
    r = y - net.forward(x)[-1]
    mu = torch.linalg.solve(S, r.T).T  # (B, O), S symmetric
    energy = 0.5 * float((r * mu).sum()) / x.shape[0]
    hidden, z = [], x
    for l in range(net.depth - 1):
        z = net.predict(l, z) + mu @ partial[l]
        hidden.append(z)
    return energy, hidden


# ---------------------------------------------------------------------------------- learning


def pc_weight_grads(net: PCNetwork, hidden: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """∂F/∂W_ℓ = −(1/B) a_ℓ ε_ℓᵀ φ(z_{ℓ−1}): each layer needs only its own error and input."""
    zs = [x, *hidden, y]
    errs = net.errors(hidden, x, y)
    grads = []
    for l, e in enumerate(errs):
        inp = zs[l] if l == 0 else net.phi(zs[l])
        w = net.output_weight if l == net.depth - 1 else 1.0
        grads.append(-w * net.scales[l] * e.T @ inp / x.shape[0])
    return grads


def bp_weight_grads(net: PCNetwork, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Backprop gradients of the quadratic loss, the reference PC is measured against."""
    ws = [w.detach().clone().requires_grad_(True) for w in net.weights]
    probe = PCNetwork(ws, net.scales, net.residual, net.activation, net.output_weight)
    return list(torch.autograd.grad(probe.loss(x, y), ws))


def pc_update(net: PCNetwork, x: torch.Tensor, y: torch.Tensor, lr: float, **infer_kwargs) -> InferenceResult:
    """One PC learning step: equilibrate the activities, then W_ℓ ← W_ℓ − lr ∂F/∂W_ℓ (local)."""
    res = infer(net, x, y, **infer_kwargs)
    for w, g in zip(net.weights, pc_weight_grads(net, res.hidden, x, y)):
        w.sub_(lr * g)
    return res


def _cos(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    fa, fb = torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b])
    denom = float(fa.norm() * fb.norm())
    return float(fa @ fb) / denom if denom > 0 else float("nan")


@dataclass
class Alignment:
    energy: float
    loss: float
    cosine: float
    layer_cosines: list[float]
    method: str
    inference: InferenceResult | None = None

    @property
    def ratio(self) -> float:
        return self.energy / self.loss if self.loss > 0 else float("nan")


def compare_pc_bp(net: PCNetwork, x: torch.Tensor, y: torch.Tensor, method: str = "auto",
                  **infer_kwargs) -> Alignment:
    """Equilibrium energy vs BP loss, and the cosine between PC and BP weight gradients."""
    if method == "auto":
        method = "closed_form" if net.activation == "linear" else "inference"
    if method == "closed_form":
        energy, hidden = linear_equilibrium(net, x, y)
        inf = None
    elif method == "inference":
        inf = infer(net, x, y, **infer_kwargs)
        energy, hidden = inf.energy, inf.hidden
    else:
        raise ValueError(f"method must be 'auto', 'closed_form' or 'inference', got {method!r}")
    pc, bp = pc_weight_grads(net, hidden, x, y), bp_weight_grads(net, x, y)
    return Alignment(energy, float(net.loss(x, y)), _cos(pc, bp), [_cos([a], [b]) for a, b in zip(pc, bp)],
                     method, inf)


# ---------------------------------------------------------------------------------- tools

Width = Annotated[int, Field(ge=1, le=4096)]
Depth = Annotated[int, Field(ge=2, le=256)]
Dim = Annotated[int, Field(ge=1, le=4096)]
Batch = Annotated[int, Field(ge=1, le=4096)]


class AlignmentReport(BaseModel):
    width: int
    depth: int
    param_type: str
    residual: bool
    activation: str
    method: str
    energy: float = Field(description="equilibrium energy F*")
    loss: float = Field(description="BP quadratic loss (λ/2B)Σ‖y − f(x)‖²")
    energy_loss_ratio: float
    grad_cosine: float = Field(description="cos(PC weight gradients, BP weight gradients), all layers")
    layer_cosines: list[float]
    inference_steps: int | None = None
    inference_converged: bool | None = None
    inference_grad_max: float | None = None


class EquilibriumCheck(BaseModel):
    simulated_energy: float
    theoretical_energy: float
    relative_gap: float
    max_activity_gap: float = Field(description="max |z_sim − z*| over layers, samples, units")
    steps: int
    converged: bool
    step_size: float


class SweepReport(BaseModel):
    param_type: str
    residual: bool
    rows: list[AlignmentReport]


def _data(input_dim: int, output_dim: int, batch_size: int, seed: int, dtype: torch.dtype,
          inputs: ArrayInput | None, targets: ArrayInput | None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    if inputs is None:
        x = torch.randn(batch_size, input_dim, generator=gen, dtype=torch.float64)
    else:
        x = torch.from_numpy(np.asarray(load_array(inputs, name="inputs"), dtype=np.float64))
        if x.ndim != 2:
            raise ValueError(f"inputs must be a 2-D array (B, input_dim), got shape {tuple(x.shape)}")
    if targets is None:
        y = torch.randn(x.shape[0], output_dim, generator=gen, dtype=torch.float64)
    else:
        y = torch.from_numpy(np.asarray(load_array(targets, name="targets"), dtype=np.float64))
        if y.ndim == 1:
            y = y[:, None]
        if y.ndim != 2 or y.shape[0] != x.shape[0]:
            raise ValueError(f"targets must have shape (B={x.shape[0]}, output_dim), got {tuple(y.shape)}")
    return x.to(dtype), y.to(dtype)


def _pc_bytes(width: int, depth: int, input_dim: int = 16, output_dim: int = 4, batch_size: int = 32,
              dtype: str = "float64", **_: object) -> float:
    """Peak working set of one comparison: the weights about six times over (layer maps, the BP
    probe's copies and gradients, PC gradients) and the activities of every layer."""
    item = 4 if dtype == "float32" else 8
    weights = depth * width * width + (input_dim + output_dim) * width
    return item * (6.0 * weights + 4.0 * depth * batch_size * width)


def _sweep_bytes(widths: list[int], depths: list[int], input_dim: int = 16, output_dim: int = 4,
                 batch_size: int = 32, **_: object) -> float:
    return max(_pc_bytes(w, d, input_dim, output_dim, batch_size) for w in widths for d in depths)


# Positive, finite numbers (NaN and infinities are refused for every tool before the call).
Positive = Annotated[float, Field(gt=0.0)]


def _report(net: PCNetwork, width: int, param_type: str, al: Alignment) -> AlignmentReport:
    inf = al.inference
    return AlignmentReport(width=width, depth=net.depth, param_type=param_type, residual=net.residual,
                           activation=net.activation, method=al.method, energy=al.energy, loss=al.loss,
                           energy_loss_ratio=al.ratio, grad_cosine=al.cosine, layer_cosines=al.layer_cosines,
                           inference_steps=inf.steps if inf else None,
                           inference_converged=inf.converged if inf else None,
                           inference_grad_max=inf.grad_max if inf else None)


@tool(timeout_s=300, isolation="process", estimate_bytes=_pc_bytes)
def pc_bp_alignment(width: Width, depth: Depth, param_type: ParamType = "mupc", residual: bool = True,
                    activation: Activation = "linear", method: Literal["auto", "closed_form", "inference"] = "auto",
                    input_dim: Dim = 16, output_dim: Dim = 4, batch_size: Batch = 32, seed: int = 0,
                    output_weight: Positive = 1.0, inputs: ArrayInput | None = None, targets: ArrayInput | None = None,
                    max_steps: Annotated[int, Field(ge=1, le=200000)] = 20000, tol: Positive = 1e-8,
                    dtype: Literal["float32", "float64"] = "float64") -> AlignmentReport:
    """How close a predictive-coding network's equilibrium is to backprop (arXiv 2602.07697).

    Reports F*/ℒ (equilibrium energy over BP loss) and the cosine between PC's local weight
    gradients and BP's; both approach 1 under μPC when width ≫ depth.

    Args:
        width: Hidden width N.
        depth: Number of weight matrices L (L−1 hidden layers).
        param_type: 'sp', 'ntp' or 'mupc'.
        residual: Identity skips on hidden layers 2..L−1.
        activation: 'linear', 'tanh' or 'relu' (nonlinear nets need method 'inference').
        method: 'closed_form' (linear nets only), 'inference' (gradient descent on activities) or 'auto'.
        input_dim: Input dimension D (ignored if inputs is given).
        output_dim: Output dimension O (ignored if targets is given).
        batch_size: Samples B of the random Gaussian batch (ignored if inputs is given).
        seed: Seed for weights and data.
        output_weight: Precision λ of the output error.
        inputs: Optional (B, D) array: .npy/.npz/.safetensors path or inline list.
        targets: Optional (B, O) array: path or inline list.
        max_steps: Inference step budget.
        tol: Inference stops when every per-sample activity gradient is below this.
        dtype: 'float64' (exact checks) or 'float32'.
    """
    dt = _DTYPES[dtype]
    x, y = _data(input_dim, output_dim, batch_size, seed, dt, inputs, targets)
    net = init_network(x.shape[1], width, depth, y.shape[1], param_type=param_type, residual=residual,
                       activation=activation, output_weight=output_weight, seed=seed, dtype=dt)
    al = compare_pc_bp(net, x, y, method, max_steps=max_steps, tol=tol)
    return _report(net, width, param_type, al)


@tool(timeout_s=300, isolation="process", estimate_bytes=_pc_bytes)
def pc_linear_equilibrium_check(width: Width, depth: Depth, param_type: ParamType = "mupc", residual: bool = True,
                                input_dim: Dim = 16, output_dim: Dim = 4, batch_size: Batch = 32, seed: int = 0,
                                output_weight: Positive = 1.0, max_steps: Annotated[int, Field(ge=1, le=200000)] = 50000,
                                tol: Positive = 1e-10, dtype: Literal["float32", "float64"] = "float64") -> EquilibriumCheck:
    """Run PC inference on a linear net and compare with the closed-form equilibrium F* = ½rᵀS⁻¹r.

    Args:
        width: Hidden width N.
        depth: Number of weight matrices L.
        param_type: 'sp', 'ntp' or 'mupc'.
        residual: Identity skips on hidden layers.
        input_dim: Input dimension D.
        output_dim: Output dimension O.
        batch_size: Number of random Gaussian samples.
        seed: Seed for weights and data.
        output_weight: Precision λ of the output error.
        max_steps: Inference step budget.
        tol: Stop when every per-sample activity gradient is below this.
        dtype: 'float64' or 'float32'.
    """
    dt = _DTYPES[dtype]
    x, y = _data(input_dim, output_dim, batch_size, seed, dt, None, None)
    net = init_network(input_dim, width, depth, output_dim, param_type=param_type, residual=residual,
                       output_weight=output_weight, seed=seed, dtype=dt)
    theory, z_star = linear_equilibrium(net, x, y)
    res = infer(net, x, y, max_steps=max_steps, tol=tol)
    gap = max(float((a - b).abs().max()) for a, b in zip(res.hidden, z_star))
    return EquilibriumCheck(simulated_energy=res.energy, theoretical_energy=theory,
                            relative_gap=abs(res.energy - theory) / max(abs(theory), 1e-300),
                            max_activity_gap=gap, steps=res.steps, converged=res.converged, step_size=res.step_size)


@tool(timeout_s=600, isolation="process", estimate_bytes=_sweep_bytes)
def pc_width_sweep(widths: Annotated[list[Width], Field(min_length=1, max_length=16)],
                   depths: Annotated[list[Depth], Field(min_length=1, max_length=16)],
                   param_type: ParamType = "mupc", residual: bool = True, input_dim: Dim = 16,
                   output_dim: Dim = 4, batch_size: Batch = 32, seed: int = 0) -> SweepReport:
    """Closed-form F*/ℒ and PC–BP gradient cosine of linear nets over a grid of widths and depths.

    Args:
        widths: Hidden widths to try (at most 16).
        depths: Depths L to try (at most 16).
        param_type: 'sp', 'ntp' or 'mupc'.
        residual: Identity skips on hidden layers.
        input_dim: Input dimension D.
        output_dim: Output dimension O.
        batch_size: Number of random Gaussian samples.
        seed: Seed for weights and data.
    """
    x, y = _data(input_dim, output_dim, batch_size, seed, torch.float64, None, None)
    rows = []
    for depth in depths:
        for width in widths:
            net = init_network(input_dim, width, depth, output_dim, param_type=param_type, residual=residual,
                               seed=seed)
            rows.append(_report(net, width, param_type, compare_pc_bp(net, x, y, "closed_form")))
    return SweepReport(param_type=param_type, residual=residual, rows=rows)


TOOLS: list[Tool] = [pc_bp_alignment, pc_linear_equilibrium_check, pc_width_sweep]
