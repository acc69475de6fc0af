"""PHALAR: learned spectral pooling into phasors, a phase-equivariant complex head and a
Hermitian bilinear similarity for musical-audio representations.

"PHALAR: phasors for learned musical audio representations" (ICML 2026, arXiv 2605.03929);
reference code gladia-research-group/phalar (MIT): ``learned_spectral_pooling.py``,
``complex_stuff.py``, ``similarity_ops.py``. Independent torch implementation on native complex
tensors (research/papers.md §18); tests check it against a verbatim copy of those three files.

Why: mean-pooling a feature sequence over time throws away *when* things happen, which is what
decides whether two stems fit together (beats must line up). Pooling with the rFFT keeps it as
phase: a time shift rotates every component, so comparing embeddings by Hermitian products
that ignore a common phase makes the model invariant to global shifts yet sensitive to relative
timing between stems.

Equations (d channels, T frames, K components):

    z_{c,k} = rFFT_ortho(h_c)[k],  k = 1…K  (DC dropped);  z ← z / (mean_{c,k} |z_{c,k}| + 1e-6)
    circular shift by s:  z_{c,k} ↦ e^{−2πi k s / T} z_{c,k}   (magnitudes unchanged)
    CplxLinear: z ↦ (A + iB) z (bias-free)       modReLU: z ↦ relu(|z|_ε + b) z / |z|_ε
    CplxRMSNorm: z ↦ w ⊙ z / sqrt(mean |z|² + 1e-6)      head: Linear → RMSNorm → modReLU → Linear
    head(e^{iφ} z) = e^{iφ} head(z)    (every step commutes with a global phase)
    similarity: ŝ(x, y) = Re(x̂ᴴ M ŷ), x̂ = x / ‖x‖, M = Wᴴ (as trained) or (W + Wᴴ)/2 (Hermitian)
    |x̂ᴴŷ| and Re(x̂ᴴMŷ) are unchanged when x and y get the same phase e^{iφ}

Front end: a constant-Q transform through nnAudio's ``CQT1992v2`` (the library the reference
uses): 16 kHz, hop 160, 96 bins from 16.35 Hz, 12 bins per octave, magnitude → dB (top 80 dB)
→ (dB + 80)/80. A pitch shift by s semitones is a translation by s bins. Deliberate difference:
the top-dB floor is per example (torchaudio's ``AmplitudeToDB`` on a (B, F, T) batch floors
against the whole batch's maximum).

Shapes: features (B, d, T) real → pooled (B, d, K) complex; encoder feature maps (B, C, F, T);
embeddings (B, D) complex. Tools exchange complex arrays in the reference's layout (…, 2, D):
real and imaginary parts stacked on the axis before the last.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, Field
from torch import nn

from closedloop.artifacts import ArrayInput, ArrayRef, array_output, load_array
from closedloop.tool import Tool, tool

__all__ = [
    "spectral_pool", "LearnedSpectralPooling", "CplxLinear", "ModReLU", "CplxRMSNorm", "ComplexHead",
    "complex_normalize", "hermitian_inner", "phase_invariant_similarity", "BilinearSimilarity",
    "to_stacked", "from_stacked", "CQTFrontend", "load_audio", "TOOLS",
]

PoolNorm = Literal["global", "channel_wise", "component_wise", "none"]


# ---------------------------------------------------------------------------------- pooling


def spectral_pool(h: torch.Tensor, components: int = 8, norm: PoolNorm = "global", center_padding: bool = True,
                  eps: float = 1e-6) -> torch.Tensor:
    """rFFT (ortho) over the last (time) axis, keep components 1…K, divide by the mean magnitude.

    Sequences shorter than 2K + 3 frames are zero-padded (centred) first, as in the reference.
    """
    if h.ndim < 2:
        raise ValueError(f"features must be (…, d, T), got shape {tuple(h.shape)}")
    if h.is_complex():
        raise ValueError("features must be real")
    if components < 1:
        raise ValueError(f"components must be ≥ 1, got {components}")
    short = max(0, 2 * (components + 1) + 1 - h.shape[-1])
    if short:
        left = short // 2 if center_padding else 0
        h = nn.functional.pad(h, (left, short - left))
    z = torch.fft.rfft(h, dim=-1, norm="ortho")[..., 1:components + 1]
    mag = z.abs()
    if norm == "global":
        scale = mag.mean(dim=(-2, -1), keepdim=True)
    elif norm == "channel_wise":
        scale = mag.mean(dim=-1, keepdim=True)
    elif norm == "component_wise":
        scale = mag.mean(dim=-2, keepdim=True)
    elif norm == "none":
        return z
    else:
        raise ValueError(f"norm must be 'global', 'channel_wise', 'component_wise' or 'none', got {norm!r}")
    return z / (scale + eps)


class LearnedSpectralPooling(nn.Module):
    """Project each frame's (F·C) features to d channels (bias-free), then :func:`spectral_pool`."""

    def __init__(self, freq_bins: int, channels: int, out_channels: int = 80, components: int = 8,
                 norm: PoolNorm = "global", center_padding: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(freq_bins * channels, out_channels, bias=False)
        nn.init.xavier_normal_(self.proj.weight)
        self.freq_bins, self.channels = freq_bins, channels
        self.components, self.norm, self.center_padding = components, norm, center_padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, F, T) real → (B, d, K) complex."""
        if x.ndim != 4 or x.shape[1] != self.channels or x.shape[2] != self.freq_bins:
            raise ValueError(f"want (B, {self.channels}, {self.freq_bins}, T), got {tuple(x.shape)}")
        h = self.proj(x.permute(0, 3, 2, 1).flatten(2)).transpose(1, 2)  # (B, T, F·C) → (B, d, T)
        return spectral_pool(h, self.components, self.norm, self.center_padding)


# ---------------------------------------------------------------------------------- complex head


class CplxLinear(nn.Module):
    """z ↦ (A + iB) z without a bias (a bias would break phase equivariance)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        w = torch.empty(2 * out_features, in_features)
        nn.init.kaiming_uniform_(w, a=5 ** 0.5)
        w /= 2 ** 0.5  # the reference's init: each of A, B gets 1/√2 of the usual scale
        self.weight_re = nn.Parameter(w[:out_features].clone())
        self.weight_im = nn.Parameter(w[out_features:].clone())

    @property
    def matrix(self) -> torch.Tensor:
        return torch.complex(self.weight_re, self.weight_im)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if not z.is_complex():
            raise ValueError("CplxLinear wants a complex tensor")
        return z @ self.matrix.to(z.dtype).transpose(0, 1)


class ModReLU(nn.Module):
    """relu(|z| + b) · z/|z| with |z| = sqrt(|z|² + 1e-6): shrinks magnitudes, keeps phases."""

    def __init__(self, channels: int, bias_init: float = -0.01) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.full((channels,), bias_init))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        mag = torch.sqrt(z.real ** 2 + z.imag ** 2 + 1e-6)
        return z * (torch.relu(mag + self.b.to(mag.dtype)) / mag)


class CplxRMSNorm(nn.Module):
    """z ↦ w ⊙ z / sqrt(mean_c |z_c|² + 1e-6), a real scale, so phases pass through."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        scale = torch.sqrt((z.real ** 2 + z.imag ** 2).mean(-1, keepdim=True) + 1e-6)
        return z / scale * self.weight.to(scale.dtype)


class ComplexHead(nn.Module):
    """The reference's complex MLP: CplxLinear → CplxRMSNorm → modReLU → CplxLinear."""

    def __init__(self, in_features: int, hidden: int = 512, out_features: int = 512) -> None:
        super().__init__()
        self.inp = CplxLinear(in_features, hidden)
        self.norm = CplxRMSNorm(hidden)
        self.act = ModReLU(hidden)
        self.out = CplxLinear(hidden, out_features)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, d, K) or (B, d·K) complex → (B, out) complex."""
        if z.ndim == 3:
            z = z.flatten(1)
        return self.out(self.act(self.norm(self.inp(z))))


# ---------------------------------------------------------------------------------- similarity


def complex_normalize(z: torch.Tensor) -> torch.Tensor:
    return z / torch.sqrt((z.real ** 2 + z.imag ** 2).sum(-1, keepdim=True) + 1e-6)


def hermitian_inner(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """All pairs xᵢᴴ yⱼ: (N, D), (M, D) → (N, M) complex."""
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"x and y need the same size, got {x.shape[-1]} and {y.shape[-1]}")
    return x.conj() @ y.transpose(-1, -2)


def phase_invariant_similarity(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|x̂ᴴŷ| ∈ [0, 1]: the complex cosine, blind to any phase of x or y."""
    return hermitian_inner(complex_normalize(x), complex_normalize(y)).abs()


class BilinearSimilarity(nn.Module):
    """Re(x̂ᴴ M ŷ) with M = Wᴴ (the reference's training form) or (W + Wᴴ)/2 (``hermitian``).

    The Hermitian form makes the score symmetric, s(x, y) = s(y, x); the paper uses it at inference.
    """

    def __init__(self, dim: int, hermitian: bool = True) -> None:
        super().__init__()
        self.W = CplxLinear(dim, dim)
        self.hermitian = hermitian

    @property
    def matrix(self) -> torch.Tensor:
        w = self.W.matrix
        return (w + w.conj().T) / 2 if self.hermitian else w.conj().T

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(N, D), (M, D) complex → (N, M) real logits."""
        xh, yh = complex_normalize(x), complex_normalize(y)
        return hermitian_inner(xh, yh @ self.matrix.to(yh.dtype).T).real


# ---------------------------------------------------------------------------------- layout


def to_stacked(z: torch.Tensor) -> torch.Tensor:
    """Complex (…, D) → real (…, 2, D), the reference's layout."""
    return torch.stack([z.real, z.imag], dim=-2)


def from_stacked(x: torch.Tensor | np.ndarray, name: str = "array") -> torch.Tensor:
    """Real (…, 2, D) → complex (…, D)."""
    x = torch.as_tensor(x)
    if x.ndim < 2 or x.shape[-2] != 2:
        raise ValueError(f"{name} must stack real and imaginary parts as (…, 2, D), got shape {tuple(x.shape)}")
    x = x.double()
    return torch.complex(x[..., 0, :], x[..., 1, :])


# ---------------------------------------------------------------------------------- CQT front end


class CQTFrontend(nn.Module):
    """nnAudio CQT magnitude → dB with an 80 dB floor (per example) → (dB + 80)/80."""

    def __init__(self, sample_rate: int = 16000, hop_length: int = 160, n_bins: int = 96, fmin: float = 16.35,
                 bins_per_octave: int = 12, top_db: float = 80.0) -> None:
        super().__init__()
        top = fmin * 2 ** ((n_bins - 1) / bins_per_octave)
        if top >= sample_rate / 2:
            raise ValueError(f"the top CQT bin ({top:.0f} Hz) must stay below Nyquist ({sample_rate / 2:.0f} Hz); "
                             "lower n_bins or fmin")
        from nnAudio.features.cqt import CQT1992v2

        self.cqt = CQT1992v2(sr=sample_rate, hop_length=hop_length, n_bins=n_bins, fmin=fmin,
                             bins_per_octave=bins_per_octave, pad_mode="constant", verbose=False)
        self.kernel_width = int(self.cqt.cqt_kernels_real.shape[-1])
        self.top_db = top_db

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        """audio (B, samples) → (B, n_bins, frames) in [0, 1] for the loudest 80 dB."""
        if audio.ndim == 1:
            audio = audio[None]
        if audio.ndim != 2:
            raise ValueError(f"audio must be (samples,) or (B, samples), got shape {tuple(audio.shape)}")
        mag = self.cqt(audio.float())
        db = 20 * torch.log10(mag.clamp_min(1e-10))
        db = torch.maximum(db, db.amax(dim=(-2, -1), keepdim=True) - self.top_db)
        return (db + self.top_db) / self.top_db


def load_audio(value: ArrayInput, sample_rate: int, name: str = "audio") -> np.ndarray:
    """Mono float audio from a .wav (resampled to ``sample_rate``), .npy/.npz/.safetensors or a list."""
    if isinstance(value, str) and value.lower().endswith(".wav"):
        from scipy.io import wavfile
        from scipy.signal import resample_poly

        from closedloop.artifacts import resolve_array_path

        path = resolve_array_path(value, name)  # inside the working root, or refused
        if not path.is_file():
            raise ValueError(f"{name}: file not found: {value}")
        if path.stat().st_size > 512 * 2**20:
            raise ValueError(f"{name}: {path.name} is over 512 MiB; use a shorter recording")
        try:
            sr, data = wavfile.read(path)
        except Exception as e:
            raise ValueError(f"{name}: cannot read {path}: {e}") from None
        if data.dtype.kind in "iu":
            data = data.astype(np.float64) / float(np.iinfo(data.dtype).max)
        data = np.asarray(data, np.float64)
        if data.ndim == 2:
            data = data.mean(1)
        if sr != sample_rate:
            g = math.gcd(int(sr), int(sample_rate))
            data = resample_poly(data, sample_rate // g, sr // g)
    else:
        data = np.asarray(load_array(value, name=name), np.float64)
    if data.ndim != 1 or data.size == 0:
        raise ValueError(f"{name} must be a non-empty mono signal (samples,), got shape {data.shape}")
    if not np.all(np.isfinite(data)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return data


# ---------------------------------------------------------------------------------- tools


class CQTReport(BaseModel):
    cqt: ArrayRef | list = Field(description="(n_bins, frames) scaled dB in [0, 1]")
    n_bins: int
    frames: int
    bin_frequencies_hz: list[float]
    peak_bin: int = Field(description="bin with the largest time-averaged value")


@tool(timeout_s=120)
def phalar_cqt(audio: ArrayInput, sample_rate: Annotated[int, Field(ge=1000, le=192000)] = 16000,
               n_bins: Annotated[int, Field(ge=1, le=256)] = 96, fmin: Annotated[float, Field(gt=0.0)] = 16.35,
               hop_length: Annotated[int, Field(ge=1)] = 160,
               bins_per_octave: Annotated[int, Field(ge=1, le=96)] = 12) -> CQTReport:
    """PHALAR's constant-Q front end (nnAudio CQT, dB, top 80 dB scaled to [0, 1]).

    Args:
        audio: Mono samples: a .wav (resampled), .npy/.npz/.safetensors path or an inline list.
        sample_rate: Rate the CQT runs at (the paper: 16000).
        n_bins: CQT bins (the paper: 96).
        fmin: Lowest bin's frequency in Hz.
        hop_length: Samples between frames.
        bins_per_octave: Bins per octave; 12 makes one bin a semitone.
    """
    x = torch.from_numpy(load_audio(audio, sample_rate))
    front = CQTFrontend(sample_rate, hop_length, n_bins, fmin, bins_per_octave)
    if x.numel() < hop_length:
        raise ValueError(f"audio has {x.numel()} samples, fewer than one hop ({hop_length})")
    with torch.no_grad():
        c = front(x)[0]
    freqs = [fmin * 2 ** (k / bins_per_octave) for k in range(n_bins)]
    return CQTReport(cqt=array_output(c.numpy(), prefix="phalar-cqt"), n_bins=n_bins, frames=int(c.shape[-1]),
                     bin_frequencies_hz=freqs, peak_bin=int(c.mean(-1).argmax()))


def _features(value: ArrayInput, name: str) -> torch.Tensor:
    arr = np.asarray(load_array(value, name=name), np.float64)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or arr.size == 0:
        raise ValueError(f"{name} must be real features (d, T) or (B, d, T), got shape {arr.shape}")
    return torch.from_numpy(arr)


class PoolReport(BaseModel):
    components: ArrayRef | list = Field(description="(B, 2, d, K): real and imaginary parts of z_{c,k}")
    shape: list[int]
    frames_after_padding: int
    shift_max_error: float | None = Field(None, description="max |pool(roll(h, s)) − e^{−2πiks/T} pool(h)|")
    shift_magnitude_change: float | None = None


@tool(timeout_s=120)
def phalar_spectral_pool(features: ArrayInput, components: Annotated[int, Field(ge=1, le=512)] = 8,
                         norm: PoolNorm = "global", check_shift: Annotated[int, Field(ge=0)] = 0) -> PoolReport:
    """PHALAR's spectral pooling of a feature sequence into K complex phasors per channel.

    Args:
        features: Real features (d, T) or (B, d, T) with time last: .npy/.npz/.safetensors path or inline list.
        components: K, the rFFT components kept (1…K; DC dropped).
        norm: Divide by the mean magnitude over 'global' (channels and components), 'channel_wise', 'component_wise' or 'none'.
        check_shift: If > 0, also verify that a circular shift by this many frames rotates component k by e^{−2πiks/T}.
    """
    h = _features(features, "features")
    z = spectral_pool(h, components, norm)
    t_eff = max(h.shape[-1], 2 * (components + 1) + 1)
    err = mag = None
    if check_shift:
        if t_eff != h.shape[-1]:
            raise ValueError(f"check_shift needs T ≥ 2K + 3 = {t_eff} frames (no padding), got {h.shape[-1]}")
        zs = spectral_pool(torch.roll(h, check_shift, -1), components, norm)
        k = torch.arange(1, components + 1, dtype=torch.float64)
        rot = torch.exp(-2j * math.pi * k * check_shift / t_eff)
        err = float((zs - rot * z).abs().max())
        mag = float((zs.abs() - z.abs()).abs().max())
    return PoolReport(components=array_output(torch.stack([z.real, z.imag], 1).numpy(), prefix="phalar-pool"),
                      shape=[int(h.shape[0]), 2, int(z.shape[1]), int(z.shape[2])], frames_after_padding=t_eff,
                      shift_max_error=err, shift_magnitude_change=mag)


class SimilarityReport(BaseModel):
    kind: str
    scores: ArrayRef | list = Field(description="(N, M) similarity matrix")
    best_match: list[int] = Field(description="for each x, the index of the y with the highest score")


@tool(timeout_s=120)
def phalar_similarity(x: ArrayInput, y: ArrayInput | None = None,
                      kind: Literal["magnitude", "hermitian"] = "magnitude",
                      weight: ArrayInput | None = None) -> SimilarityReport:
    """Compare complex embeddings: |x̂ᴴŷ| (phase-blind cosine) or the Hermitian bilinear Re(x̂ᴴMŷ).

    Args:
        x: Complex embeddings (N, 2, D) or (2, D), real and imaginary parts stacked; path or inline list.
        y: Embeddings like x (M, 2, D); defaults to x.
        kind: 'magnitude' for |x̂ᴴŷ|, 'hermitian' for Re(x̂ᴴ (W + Wᴴ)/2 ŷ).
        weight: W for kind='hermitian' as (2, D, D) real/imaginary; identity if omitted.
    """
    xs = from_stacked(np.asarray(load_array(x, name="x")), "x")
    ys = from_stacked(np.asarray(load_array(y, name="y")), "y") if y is not None else xs
    xs, ys = xs.reshape(-1, xs.shape[-1]), ys.reshape(-1, ys.shape[-1])
    if xs.shape[-1] != ys.shape[-1]:
        raise ValueError(f"x and y need the same embedding size, got {xs.shape[-1]} and {ys.shape[-1]}")
    d = xs.shape[-1]
    if kind == "magnitude":
        if weight is not None:
            raise ValueError("weight only applies to kind='hermitian'")
        s = phase_invariant_similarity(xs, ys)
    else:
        if weight is None:
            m = torch.eye(d, dtype=torch.complex128)
        else:
            w = np.asarray(load_array(weight, name="weight"), np.float64)
            if w.shape != (2, d, d):
                raise ValueError(f"weight must have shape (2, {d}, {d}), got {w.shape}")
            wc = torch.complex(torch.from_numpy(w[0]), torch.from_numpy(w[1]))
            m = (wc + wc.conj().T) / 2
        s = hermitian_inner(complex_normalize(xs), complex_normalize(ys) @ m.T).real
    return SimilarityReport(kind=kind, scores=array_output(s.numpy(), prefix="phalar-sim"),
                            best_match=[int(i) for i in s.argmax(1)])


TOOLS: list[Tool] = [phalar_cqt, phalar_spectral_pool, phalar_similarity]
