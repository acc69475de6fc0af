"""ArBG: one-pass exact likelihood vs a prefix-by-prefix loop, our E-W2 vs POT, and a toy run.

AutoBG itself (Lightning + Hydra + peptide data) does not run here, so the peers are
straightforward versions: the likelihood computed one coordinate at a time (D forward passes
on growing prefixes, what sampling has to do) against the single causal pass; and the 1-D
Wasserstein-2 through POT's ``ot.emd2_1d`` (what AutoBG calls) against our quantile form. Both
pairs are checked to agree before timing. Last, trains on a toy energy and prints ESS and E-W2.

    python benchmarks/bench_arbg.py [--dims 2 22 66] [--batch 256] [--toy gmm]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F

from closedloop.tools.arbg import ARModel, energy_w2, ess, filter_logits, run_toy, sequence_log_prob, snis_weights
from _timing import best_time


def prefix_loop(model: ARModel, bins: torch.Tensor, temperature: float, top_p: float | None) -> torch.Tensor:
    total = torch.zeros(bins.shape[0])
    for j in range(model.dim):
        logp = F.log_softmax(filter_logits(model(bins[:, :j])[:, -1], temperature, top_p), -1)
        total += logp.gather(-1, bins[:, j:j + 1]).squeeze(-1)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[2, 22, 66], help="coordinates (ALDP: 66)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--toy", default="gmm", choices=["gmm", "double_well", "double_well_1d"])
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"== exact log-likelihood, 256 bins, batch {a.batch}, T=0.9, top-p=0.95, {torch.get_num_threads()} threads ==")
    print(f"{'D':>4} {'one pass ms':>12} {'prefix loop ms':>15} {'one/loop':>9} {'max |diff|':>11}")
    with torch.no_grad():
        for d in a.dims:
            m = ARModel(d).eval()
            bins = torch.randint(0, 256, (a.batch, d))
            one, loop = sequence_log_prob(m, bins, 0.9, 0.95), prefix_loop(m, bins, 0.9, 0.95)
            fin = torch.isfinite(one)  # random bins can fall outside the nucleus: −inf in both
            assert torch.equal(fin, torch.isfinite(loop))
            diff = float((one[fin] - loop[fin]).abs().max()) if fin.any() else 0.0
            t1 = best_time(lambda: sequence_log_prob(m, bins, 0.9, 0.95), a.repeats)
            t2 = best_time(lambda: prefix_loop(m, bins, 0.9, 0.95), max(1, a.repeats // 2))
            print(f"{d:>4} {1e3 * t1:>12.2f} {1e3 * t2:>15.2f} {t1 / t2:>9.3f} {diff:>11.2e}")

    import ot

    rng = np.random.default_rng(0)
    print("\n== E-W2 (1-D W2), ours vs POT ot.emd2_1d ==")
    print(f"{'n':>8} {'ours ms':>9} {'POT ms':>9} {'ours/POT':>9} {'rel diff':>9}")
    for n in (1000, 10000, 100000):
        e_true, e_pred, w = rng.normal(size=n), rng.normal(0.3, 1.2, size=n), rng.random(n)
        ours = energy_w2(e_true, e_pred, w)
        ref = math.sqrt(ot.emd2_1d(e_true, e_pred, np.full(n, 1 / n), w / w.sum()))
        t1 = best_time(lambda: energy_w2(e_true, e_pred, w), a.repeats)
        t2 = best_time(lambda: ot.emd2_1d(e_true, e_pred, np.full(n, 1 / n), w / w.sum()), a.repeats)
        print(f"{n:>8} {1e3 * t1:>9.2f} {1e3 * t2:>9.2f} {t1 / t2:>9.2f} {abs(ours - ref) / ref:>9.1e}")

    print(f"\n== toy run: {a.toy}, {a.steps} Adam steps, 5000 samples ==")
    run = run_toy(a.toy, steps=a.steps, n_samples=5000, progress=True)
    w = snis_weights(run.log_w)
    ref_e = run.reference
    from closedloop.tools.arbg import toy_energy

    e_ref = toy_energy(a.toy).energy(ref_e).numpy()
    print(f"train {run.train_s:.1f} s, final NLL {np.mean(run.losses[-10:]):.3f} nats; "
          f"ESS {ess(run.log_w):.0f}/5000; E-W2 raw {energy_w2(e_ref, run.energy.numpy()):.4f} "
          f"→ reweighted {energy_w2(e_ref, run.energy.numpy(), w.numpy()):.4f}")


if __name__ == "__main__":
    main()
