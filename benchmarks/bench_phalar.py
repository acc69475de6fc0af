"""PHALAR pooling + complex head + similarity: our native-complex torch code vs the official code.

The official implementation (gladia-research-group/phalar; its torch-only classes are copied
verbatim in tests/tools/_phalar_reference.py) runs here on CPU, so it is the peer: both get the
same weights and inputs, the script checks they agree, then times the forward pass
(spectral pooling of (B, C, F, T) feature maps → complex head → B×B Hermitian similarity) and
prints ours/official. Also times the nnAudio CQT front end per second of audio (no peer).

    python benchmarks/bench_phalar.py [--batch 64] [--frames 500] [--repeats 10]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from closedloop.tools.phalar import BilinearSimilarity, ComplexHead, CQTFrontend, LearnedSpectralPooling, to_stacked
from _timing import best_time


def official():
    path = Path(__file__).resolve().parents[1] / "tests" / "tools" / "_phalar_reference.py"
    spec = importlib.util.spec_from_file_location("_phalar_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--channels", type=int, default=8)
    ap.add_argument("--freq", type=int, default=24)
    ap.add_argument("--frames", type=int, default=500)
    ap.add_argument("--dim", type=int, default=80)
    ap.add_argument("--components", type=int, default=8)
    ap.add_argument("--embedding", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    ref = official()
    torch.manual_seed(0)
    x = torch.randn(a.batch, a.channels, a.freq, a.frames)
    pool = LearnedSpectralPooling(a.freq, a.channels, a.dim, a.components)
    head = ComplexHead(a.dim * a.components, a.embedding, a.embedding)
    sim = BilinearSimilarity(a.embedding, hermitian=True)

    proj = torch.nn.Sequential(torch.nn.Flatten(2), torch.nn.Linear(a.freq * a.channels, a.dim, bias=False))
    proj[1].weight.data.copy_(pool.proj.weight.data)
    r_pool = ref.LearnedFeaturesSpectralPooling(proj, a.dim, a.components, complex_output=True, norm="global")
    r_head = torch.nn.Sequential(ref.CplxLinear(a.dim * a.components, a.embedding), ref.CplxRMSNorm(a.embedding),
                                 ref.modReLU(a.embedding), ref.CplxLinear(a.embedding, a.embedding))
    r_head[0].W.weight.data.copy_(torch.cat([head.inp.weight_re, head.inp.weight_im]).data)
    r_head[3].W.weight.data.copy_(torch.cat([head.out.weight_re, head.out.weight_im]).data)
    r_sim = ref.CplxBilinearSimilarity(a.embedding, hermitian=True)
    r_sim.W.W.weight.data.copy_(torch.cat([sim.W.weight_re, sim.W.weight_im]).data)

    def ours():
        e = head(pool(x))
        return sim(e, e)

    def theirs():
        e = r_head(r_pool(x).flatten(2))
        return r_sim(e, e)

    with torch.no_grad():
        diff = float((ours() - theirs()).abs().max())
        emb_diff = float((to_stacked(head(pool(x))) - r_head(r_pool(x).flatten(2))).abs().max())
        t_ours, t_ref = best_time(ours, a.repeats), best_time(theirs, a.repeats)
    print(f"== pooling + head + {a.batch}x{a.batch} Hermitian similarity, float32, {torch.get_num_threads()} threads ==")
    print(f"input (B, C, F, T) = ({a.batch}, {a.channels}, {a.freq}, {a.frames}); d={a.dim}, K={a.components}, "
          f"D={a.embedding}")
    print(f"max |ours − official|: similarity {diff:.2e}, embedding {emb_diff:.2e}")
    print(f"ours {1e3 * t_ours:8.2f} ms   official {1e3 * t_ref:8.2f} ms   ours/official {t_ours / t_ref:.2f}")

    front = CQTFrontend()
    audio = torch.randn(4, 16000 * 5)
    with torch.no_grad():
        t_cqt = best_time(lambda: front(audio), max(3, a.repeats // 3))
    print(f"CQT front end (nnAudio, 96 bins, hop 160): {1e3 * t_cqt / 20:.1f} ms per second of audio")


if __name__ == "__main__":
    main()
