"""Paper 6's pathology on a toy: DPO "converges" while the policy still prefers the rejected answer.

The tiny model (or ``--model``) is the reference and the starting policy. The pair is the
candidate (prompt "colour?", one-word answers) whose reference preference is nearest Δref = −2
nats per token *against* the chosen answer (the tests' ``_toy_rows``). DPO and the three
Constrained Preference Optimization branches (``cpref``: cpo, easy, clip) then train on it with
the same β, learning rate, steps and length-normalised log-probs; Δθ = ℓθ(y_w) − ℓθ(y_l) is
measured on the trained policy.

    python benchmarks/bench_preference_pathology.py --steps 200
    python benchmarks/bench_preference_pathology.py --beta 2.5 --gamma 0.05 --steps 300

DPO's loss goes to ~0 with Δθ < 0 (it only needs Δθ > Δref); the cpo branch's target is
≈ γ above 0, so it ends with Δθ > 0. CI runs a 40-step version
(``tests/trainers/test_preference.py::test_toy_training_dpo_ends_preferring_rejected_constrained_does_not``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CANDIDATES = [("blue", "red"), ("yes", "no"), ("cat", "dog"), ("Hello!", "Thanks!")]


def toy_row(model, tokenizer):
    from closedloop.trainers.dpo import policy_margins
    from closedloop.trainers.preference_data import encode_preference_rows

    best = None
    for a, b in CANDIDATES:
        row = {"prompt": [{"role": "user", "content": "colour?"}], "chosen": [{"role": "assistant", "content": a}],
               "rejected": [{"role": "assistant", "content": b}]}
        d = float(policy_margins(model, encode_preference_rows([row], tokenizer), tokenizer.pad_token_id,
                                 length_normalize=True)[0])
        if d > 0:
            row["chosen"], row["rejected"], d = row["rejected"], row["chosen"], -d
        if d <= -1.5 and (best is None or abs(d + 2) < abs(best[1] + 2)):
            best = (row, d)
    if best is None:
        sys.exit("no candidate pair whose reference prefers the rejected answer by >= 1.5 nats/token")
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: build the tiny model)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--beta", type=float, default=5.0)
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--tau", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-5)
    args = p.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from closedloop.trainers.config import load_config
    from closedloop.trainers.cpref import ConstrainedPreferenceConfig, train_cpref
    from closedloop.trainers.dpo import DPOConfig, policy_margins, train_dpo
    from closedloop.trainers.preference_data import encode_preference_rows

    torch.set_num_threads(1)
    console = Console(width=150)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = args.model
        if model_path is None:
            from closedloop.models.tiny import build_tiny_model

            model_path = str(build_tiny_model(Path(tmp) / "tiny"))
        tok = AutoTokenizer.from_pretrained(model_path)
        row, d_ref = toy_row(AutoModelForCausalLM.from_pretrained(model_path), tok)
        pairs = encode_preference_rows([row], tok)
        console.print(f"pair: chosen {row['chosen'][0]['content']!r}, rejected {row['rejected'][0]['content']!r}; "
                      f"Δref = {d_ref:.3f} nats/token")
        common = [f"model={model_path}", "report_to=none", f"max_steps={args.steps}", "per_device_batch_size=1",
                  "torch_threads=1", f"beta={args.beta}", f"learning_rate={args.lr}", "lr_scheduler=constant",
                  "max_grad_norm=null", "length_normalize=true", f"logging_steps={args.steps}"]
        runs = [("dpo (sigmoid)", DPOConfig, train_dpo, [])]
        for variant in ("cpo", "easy", "clip"):
            runs.append((f"cpref {variant}", ConstrainedPreferenceConfig, train_cpref,
                         [f"variant={variant}", f"gamma={args.gamma}", f"tau={args.tau}", f"alpha={args.alpha}"]))
        table = Table(title=f"Δref = {d_ref:.2f}; β={args.beta}, lr={args.lr}, {args.steps} steps; γ={args.gamma}, "
                            f"τ={args.tau}, α={args.alpha}; ℓ length-normalised")
        checkpoints = sorted({max(1, args.steps // 10), args.steps // 4, args.steps // 2, args.steps})
        for col in ["run", "final loss", *[f"Δθ @{s}" for s in checkpoints], "final Δθ (trained policy)",
                    "prefers chosen"]:
            table.add_column(col, justify="left" if col == "run" else "right")
        for i, (name, cls, train, extra) in enumerate(runs):
            model = AutoModelForCausalLM.from_pretrained(model_path)
            result = train(load_config(cls, None, common + extra + [f"output_dir={Path(tmp) / str(i)}"]), [row],
                           model=model, tokenizer=tok)
            hist = {h["step"]: h for h in result.history}
            final = float(policy_margins(model, pairs, tok.pad_token_id, length_normalize=True)[0])
            table.add_row(name, f"{result.history[-1]['loss']:.2e}",
                          *[f"{hist[s]['delta_theta']:+.3f}" for s in checkpoints], f"{final:+.3f}",
                          "yes" if final > 0 else "no")
        console.print(table)
        console.print("Δθ @s: Δθ on the pair at step s (before that step's update); DPO's loss < log 2 from the "
                      "first update on, since Δθ > Δref.")


if __name__ == "__main__":
    main()
