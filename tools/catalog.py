"""One line per built-in tool, so ``closedloop tools`` lists them without importing the tool modules.

The modules import torch, scipy, sacrebleu and PyAV at the top; this table is what the listing
needs (name, whether it writes, the first line of its description), keyed by the tool module's
entry point. ``tests/cli/test_tools_catalog.py`` checks it against the real tools and prints the
corrected table (:func:`render`) when a tool changes. A tool module not listed here (a user's) is
imported to be described.
"""

from __future__ import annotations

import json
from typing import NamedTuple


class ToolSummary(NamedTuple):
    name: str
    mutates: bool
    description: str  # the first line of Tool.description


CATALOG: dict[str, tuple[ToolSummary, ...]] = {
    "closedloop.tools.arbg:TOOLS": (
        ToolSummary("arbg_toy", False,
                    "Train a discretised autoregressive Boltzmann generator on a toy energy, sample, reweight, score."),
        ToolSummary("arbg_snis", False,
                    "Self-normalised importance weights w ∝ exp(−βE(x) − log q(x)) and their Kish ESS."),
        ToolSummary("arbg_energy_w2", False,
                    "E-W2: the 1-D Wasserstein-2 distance between target and generated energy distributions."),
    ),
    "closedloop.tools.arithmetic:TOOLS": (
        ToolSummary("add", False,
                    "Add two numbers."),
        ToolSummary("multiply", False,
                    "Multiply two numbers."),
    ),
    "closedloop.tools.cartesian_3j:TOOLS": (
        ToolSummary("cartesian_decompose", False,
                    "Split a rank-n Cartesian tensor (3**n components, n = 1..6) into its irreducible weight-l parts."),
        ToolSummary("cartesian_3j_tensor", False,
                    "The invariant coupling tensor of weights l_a ⊗ l_b → l_c (a Cartesian-3j symbol)."),
        ToolSummary("cartesian_change_of_basis", False,
                    "Orthonormal change-of-basis matrices from each weight-l irreducible copy into rank-n tensors."),
        ToolSummary("cartesian_couple", False,
                    "Couple two Cartesian tensors of ranks l_a, l_b into weight l_c with the Cartesian-3j symbol."),
    ),
    "closedloop.tools.cgp_probe:TOOLS": (
        ToolSummary("cgp_probe_features", False,
                    "Fit a convex gated prototype probe on frozen per-layer features; report the gates and best layer."),
        ToolSummary("cgp_probe_hf", False,
                    "Which layer of an HF model knows the label: CGP probe on its frozen hidden states."),
    ),
    "closedloop.tools.conditional_krr:TOOLS": (
        ToolSummary("conditional_krr_fit", False,
                    "Fit conditional kernel ridge regression (unpenalised class F + kernel ridge on the rest) on an .npz dataset"),
        ToolSummary("residual_kernel_spectrum", False,
                    "Spectrum of the Gram matrix K and of the residual Gram Pi K Pi left after removing F: how much of the kernel"),
    ),
    "closedloop.tools.culture_mt:TOOLS": (
        ToolSummary("culture_mt_notes", False,
                    "Load CULTURE-MT notes and count them by domain and type; optionally check the published shape (1,002 notes,"),
        ToolSummary("culture_mt_metrics", False,
                    "Corpus BLEU and chrF (sacrebleu) of translations against the notes' references, overall and per note type."),
        ToolSummary("culture_mt_judge", False,
                    "Judge translations for expression accuracy and cultural adaptability (1-5 each, rubric in"),
        ToolSummary("culture_mt_correlation", False,
                    "Spearman and Kendall tau-b between a surface metric and a judge score in a judgments file written by"),
    ),
    "closedloop.tools.fog_attribution:TOOLS": (
        ToolSummary("fog_layer_attribution", False,
                    "Forward-only gate ablation of an HF causal LM: Δ per decoder layer and the top-k layers."),
        ToolSummary("fog_select_layers", False,
                    "Top-k layers by FoG-A Δ with alignment weights λ_k ∝ Δ_k."),
    ),
    "closedloop.tools.mesh_certificate:TOOLS": (
        ToolSummary("compatibility_certificate", False,
                    "Distance of a learned operator pair to chain compatibility: ||D1 D0||_F and ||D1 D0||_F/(||D1|| ||D0||)."),
        ToolSummary("project_to_compatible", False,
                    "Frobenius-nearest chain-compatible operator pair, with certificates before and after."),
        ToolSummary("hodge_spectrum", False,
                    "Learned Hodge Laplacians L0 = D0^T D0, L1 = D0 D0^T + D1^T D1: condition numbers on the nonzero spectrum,"),
        ToolSummary("mesh_incidence", False,
                    "Exact signed incidence operators D0 (edges x vertices) and D1 (faces x edges) of a triangle mesh,"),
        ToolSummary("grid_mesh_operators", False,
                    "Triangulated n x n grid (a disk) with optional removed cells (each interior 4-connected block = one hole),"),
    ),
    "closedloop.tools.phalar:TOOLS": (
        ToolSummary("phalar_cqt", False,
                    "PHALAR's constant-Q front end (nnAudio CQT, dB, top 80 dB scaled to [0, 1])."),
        ToolSummary("phalar_spectral_pool", False,
                    "PHALAR's spectral pooling of a feature sequence into K complex phasors per channel."),
        ToolSummary("phalar_similarity", False,
                    "Compare complex embeddings: |x̂ᴴŷ| (phase-blind cosine) or the Hermitian bilinear Re(x̂ᴴMŷ)."),
    ),
    "closedloop.tools.predictive_coding:TOOLS": (
        ToolSummary("pc_bp_alignment", False,
                    "How close a predictive-coding network's equilibrium is to backprop (arXiv 2602.07697)."),
        ToolSummary("pc_linear_equilibrium_check", False,
                    "Run PC inference on a linear net and compare with the closed-form equilibrium F* = ½rᵀS⁻¹r."),
        ToolSummary("pc_width_sweep", False,
                    "Closed-form F*/ℒ and PC–BP gradient cosine of linear nets over a grid of widths and depths."),
    ),
    "closedloop.tools.spike_dice_attention:TOOLS": (
        ToolSummary("spike_attention_density_bias", False,
                    "How much spiking attention scores follow firing density: SDA and Lin-SDA vs dot product."),
        ToolSummary("spike_attention_scores", False,
                    "Score map between binary spike queries and keys: Dice (SDA), linear Dice or dot product."),
    ),
    "closedloop.tools.starcaster:TOOLS": (
        ToolSummary("identity_similarity", False,
                    "Identity preservation: cosine of each frame's face embedding (e.g. ArcFace) with the reference identity embedding."),
        ToolSummary("av_sync_offset", False,
                    "Audio-visual sync as SyncNet computes it: the offset minimising the mean feature distance, LSE-D (that"),
        ToolSummary("static_drift_check", False,
                    "Detect an autoregressive rollout collapsing to static motion after its training context."),
        ToolSummary("frechet_video_distance", False,
                    "Fréchet distance between Gaussian fits of two sets: precomputed per-video features (e.g. I3D) or raw videos"),
    ),
    "closedloop.tools.ziprerank:TOOLS": (
        ToolSummary("ziprerank_rerank", False,
                    "Listwise rerank with one forward per window (label first-token logits)."),
        ToolSummary("ziprerank_evaluate", False,
                    "Recall@k and nDCG@k of the first-stage order and of the listwise rerank on a local ranking set."),
        ToolSummary("ziprerank_prune_patches", False,
                    "QI-EI: keep the patches most similar to any query token (max cosine), in spatial order."),
        ToolSummary("ziprerank_losses", False,
                    "Soft-ranking cross-entropy (GT first, teacher order, decay^position) and RankNet for one list."),
    ),
}


def render(catalog: dict[str, tuple[ToolSummary, ...]]) -> str:
    """The ``CATALOG = {...}`` entries as this file writes them."""
    lines = []
    for target, tools in catalog.items():
        lines.append(f"    {json.dumps(target)}: (")
        lines += [f"        ToolSummary({json.dumps(t.name)}, {t.mutates},\n"
                  f"                    {json.dumps(t.description, ensure_ascii=False)})," for t in tools]
        lines.append("    ),")
    return "\n".join(lines) + "\n"
