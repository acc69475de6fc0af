"""FactGuard's risk weights move precision and recall (paper 1, checkable (c)): a small local experiment.

Synthetic FactGuard data (half the claims settled by the corpus, half unsettled), the tiny model,
SFT on teacher trajectories (answer from the FactProbe report; on an unsettled claim "real", or
with ``--unsettled-fake p`` "fake" with probability p), then GRPO with the decision-aware reward in
arms from the same SFT model, same seeds and steps, differing only in α:γ (``--weights``; α is the
cost of flagging a real video, γ of passing a fake one). Each policy is evaluated greedily on the
temporal test split; "fake" is the positive class.

By default the FactProbe report on the claim is put in the prompt and the policy answers once
(``evidence_in_prompt``): the 150k-parameter model does not learn the two-stage tool loop on
650-token prompts in minutes of CPU; ``--full-agent`` runs the whole agent for a real model.

The paper's claim: raising α relative to γ raises precision and lowers recall
(FakeSV: 1:2 → P/R 80.8/82.1; 2:1 → 83.2/75.0).

    python benchmarks/exp_factguard_risk.py --out out/factguard_risk          # defaults: no effect, see below
    python benchmarks/exp_factguard_risk.py --quick --out /tmp/fg_quick       # mechanics only

Two conditions for α:γ to matter at all (what the defaults lack; with them, arms 1:2/2:1 and 1:4/4:1
came out equal to SFT or apart by noise):

* The policy must be uncertain somewhere. A teacher that always says "real" on unsettled claims
  gives a near-deterministic SFT policy: every GRPO group answers alike, advantage 0.
  ``--unsettled-fake 0.5 --expert-passes 2`` (a calibrated teacher; two passes disagree) keeps it
  uncertain exactly on the claims the evidence does not settle, where the risk weights decide.
* The advantage must keep the reward's scale. Within a group the sample (so the label) is fixed,
  and a binary decision gives two reward levels; GRPO's per-group std (``scale_rewards: group``,
  TRL's default) maps any two levels to the same ±advantages, so α and γ cancel out.
  ``--scale-rewards batch`` (or ``none``, Dr. GRPO) keeps the gap 1+γ (fake sample) vs 1+α (real).

Result (900 samples: 765 train, 135 test; SFT 600 steps; GRPO 40 steps, lr 3e-4, 8 prompts × G=8,
T=1; 3 GRPO seeds per arm from one SFT model; 35 min on 2 shared CPUs)::

    python benchmarks/exp_factguard_risk.py --out out/fg_risk --samples 900 --sft-steps 600 \
        --grpo-steps 40 --unsettled-fake 0.5 --expert-passes 2 --scale-rewards batch --seeds 3 \
        --weights 1:4,4:1,1:1

    arm (α:γ)   seed  P [95% CI]         R [95% CI]         F1     acc    P(fake)  P(fake|unsettled)
    SFT          -    0.803 [0.69,0.88]  0.710 [0.59,0.80]  0.754  0.756  0.452    0.273
    1:4          0    0.765 [0.65,0.85]  0.754 [0.64,0.84]  0.759  0.756  0.504    0.364
    1:4          1    0.682 [0.58,0.77]  0.841 [0.74,0.91]  0.753  0.719  0.630    0.576
    1:4          2    0.836 [0.72,0.91]  0.667 [0.55,0.77]  0.742  0.763  0.407    0.212
    1:1          0-2  0.978 [0.88,1.00]  0.638 [0.52,0.74]  0.772  0.807  0.333    0.091
    4:1          0-2  0.978 [0.88,1.00]  0.638 [0.52,0.74]  0.772  0.807  0.333    0.091

With 80 GRPO steps instead (same SFT model; ``--sft-from``), 1:4 moves further toward flagging and
4:1 stays put::

    1:4          0    0.644 [0.54,0.74]  0.841 [0.74,0.91]  0.730  0.681  0.667    0.591
    1:4          1    0.757 [0.65,0.84]  0.768 [0.66,0.85]  0.763  0.756  0.519    0.394
    1:4          2    0.519 [0.43,0.60]  0.971 [0.90,0.99]  0.677  0.526  0.956    0.939
    4:1          0    0.978 [0.88,1.00]  0.638 [0.52,0.74]  0.772  0.807  0.333    0.091

Raising α relative to γ raised precision and lowered recall in every seed pair (9 at 40 steps, 3
at 80). But it is one-sided: 1:1 lands where 4:1 does (GRPO also drifts toward "real" on unsettled
claims without any risk asymmetry; the SFT policy already leans that way), so 1:4 mainly resists
that drift, and its seeds scatter; at 40 steps the intervals of seed 2 overlap 4:1's. Control:
``--scale-rewards group`` with 1:4 and 4:1 (seed 0, 40 steps) gives identical policies (P 0.978,
R 0.638 both), as the cancellation above predicts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def evaluate_arm(model_dir: Path, env_options: dict, n_test: int) -> dict:
    from closedloop.evals.envs import make_env
    from closedloop.evals.factguard.data import binary_metrics
    from closedloop.models.base import SamplingParams
    from closedloop.models.hf import HFClient
    from closedloop.trainers.evaluate import evaluate

    client = HFClient.from_pretrained(model_dir, max_batch_size=64)
    opts = {**env_options, "split": "test"}
    _, episodes = evaluate(client, lambda: make_env("factguard", **opts), range(n_test), name=model_dir.name,
                           graph="factguard", params=SamplingParams(temperature=0, max_tokens=96))
    preds = [e.info.get("predicted") for e in episodes]
    labels = [e.info.get("label") for e in episodes]
    m = binary_metrics(preds, labels, bootstrap=500)
    tools = sum(bool(e.info.get("tools_used")) for e in episodes) / len(episodes)
    # Where the decision is made: claims the corpus settles (synthetic doc ids are doc-<sample id>) vs not.
    corpus = Path(env_options["data_dir"]) / "corpus.jsonl"
    settled = {json.loads(line)["id"].removeprefix("doc-") for line in corpus.read_text().splitlines() if line}
    unsettled = [e.info.get("predicted") for e in episodes if e.info.get("sample") not in settled]
    right = [e.info.get("predicted") == e.info.get("label") for e in episodes if e.info.get("sample") in settled]
    return {**m.model_dump(), "tool_rate": tools, "p_fake": sum(p == "fake" for p in preds) / len(preds),
            "p_fake_unsettled": _mean([p == "fake" for p in unsettled]), "acc_settled": _mean(right)}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/factguard_risk")
    ap.add_argument("--model", help="base checkpoint dir (default: build the tiny model)")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--grpo-lr", type=float, default=3e-4)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--weights", default="1:2,2:1",
                    help="the arms' alpha:gamma (comma-separated; the paper's Table 2 uses 1:2 and 2:1)")
    ap.add_argument("--seeds", type=int, default=1, help="GRPO runs per arm (seeds 0..N-1), all from one SFT model")
    ap.add_argument("--unsettled-fake", type=float, default=0.0,
                    help="the teacher's probability of 'fake' on claims the evidence does not settle (0: always "
                         "'real', which leaves the SFT policy no uncertainty for GRPO to resolve)")
    ap.add_argument("--expert-passes", type=int, default=1,
                    help="teacher episodes per training sample (with --unsettled-fake, passes disagree)")
    ap.add_argument("--scale-rewards", choices=["group", "batch", "none"], default="group",
                    help="GRPO's advantage scaling; 'group' divides out a binary decision's reward gap, and with "
                         "it alpha:gamma (see the docstring)")
    ap.add_argument("--sft-from", help="an SFT checkpoint of an earlier run (its data dir must be --out's): skip SFT")
    ap.add_argument("--full-agent", action="store_true",
                    help="the two-stage agent with tools (default: the report in the prompt, one answer)")
    args = ap.parse_args()

    import torch

    from closedloop.evals.envs.experts import expert_trajectories
    from closedloop.evals.factguard.data import load_samples, temporal_split
    from closedloop.evals.factguard.synthetic import make_synthetic
    from closedloop.trainers.config import SFTConfig
    from closedloop.trainers.grpo import GRPOConfig, train_grpo
    from closedloop.trainers.sft import train_sft

    torch.set_num_threads(1)
    if args.quick:
        args.samples, args.sft_steps, args.grpo_steps = 40, 4, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data = out / "data"
    if not (data / "samples.jsonl").exists():
        make_synthetic(data, n=args.samples, seed=0, evidence_rate=0.5, videos=False)
    train, test = temporal_split(load_samples(data))
    base = Path(args.model) if args.model else out / "base"
    if not args.model and not (base / "config.json").exists():
        from closedloop.models.tiny import build_tiny_model

        build_tiny_model(base, seed=0, train_steps=300 if args.quick else 1000)
    env_options: dict = {"data_dir": str(data), "max_turns": 3}
    if not args.full_agent:  # the tiny model cannot learn the two-stage tool loop on long prompts in minutes
        env_options.update(evidence_in_prompt=True, max_turns=1, search_k=1,
                           system_prompt="Is the video real or fake? Reply <think>why</think><answer>real</answer> "
                                         "or <answer>fake</answer>.")
    teacher = {**env_options, "expert_unsettled_fake": args.unsettled_fake} if args.unsettled_fake else env_options
    if args.sft_from:
        sft_dir = Path(args.sft_from)
    else:
        experts = expert_trajectories("factguard", range(len(train) * args.expert_passes), **teacher)
        sft_dir = Path(train_sft(SFTConfig(model=str(base), output_dir=str(out / "sft"), max_steps=args.sft_steps,
                              learning_rate=3e-3, lr_scheduler="cosine", warmup_steps=max(1, args.sft_steps // 20),
                              per_device_batch_size=16, seed=0, save_steps=None, save_total_limit=1,
                              torch_threads=1, logging_steps=max(1, args.sft_steps // 5), run_name="fg-sft"),
                                   experts).output_dir)
    results: dict = {"sft": evaluate_arm(sft_dir, env_options, len(test)), "runs": {}}
    results["args"] = vars(args)
    arms = []
    for w in args.weights.split(","):
        a, g = (float(x) for x in w.split(":"))
        arms.append((f"alpha{a:g}_gamma{g:g}", a, g))
    for name, alpha, gamma in arms:
        for seed in range(args.seeds):
            run = f"{name}_seed{seed}" if args.seeds > 1 else name
            opts = {**env_options, "reward": {"alpha": alpha, "gamma": gamma}}
            grpo = train_grpo(GRPOConfig(model=str(sft_dir), output_dir=str(out / run), env="factguard",
                                         env_options=opts, graph="factguard", max_steps=args.grpo_steps,
                                         learning_rate=args.grpo_lr, lr_scheduler="constant", prompts_per_step=8,
                                         num_generations=8, temperature=1.0, loss_type="dapo",
                                         scale_rewards=args.scale_rewards, train_seed_start=0,
                                         per_device_batch_size=16, seed=seed, save_steps=None, save_total_limit=1,
                                         torch_threads=1, logging_steps=max(1, args.grpo_steps // 5), run_name=run))
            r = evaluate_arm(Path(grpo.output_dir), env_options, len(test))
            # Is there a learning signal? The share of groups whose G answers all scored alike (advantage 0).
            r["frac_zero_std_groups"] = _mean([h.get("frac_zero_std_groups", float("nan")) for h in grpo.history])
            r["arm"], r["seed"] = name, seed
            results["runs"][run] = r
            (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
            print(f"{run}: P {r['precision']:.3f} R {r['recall']:.3f} P(fake) {r['p_fake']:.3f} "
                  f"P(fake|unsettled) {r['p_fake_unsettled']:.3f} "
                  f"zero-std groups {r['frac_zero_std_groups']:.2f}", flush=True)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    results["n_train"], results["n_test"] = len(train), len(test)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"{'policy':24s} {'P [95% CI]':>20s} {'R [95% CI]':>20s} {'F1':>6s} {'Acc':>6s} {'P(fake)':>7s} "
          f"{'P(f|uns)':>8s} {'acc|set':>7s} {'0-std':>6s}")
    rows = [("sft", results["sft"])] + list(results["runs"].items())
    for k, r in rows:
        p_ci, r_ci = r["precision_ci"], r["recall_ci"]
        print(f"{k:24s} {r['precision']:6.3f} [{p_ci[0]:.2f},{p_ci[1]:.2f}] {r['recall']:6.3f} "
              f"[{r_ci[0]:.2f},{r_ci[1]:.2f}] {r['f1']:6.3f} {r['accuracy']:6.3f} {r['p_fake']:7.3f} "
              f"{r['p_fake_unsettled']:8.3f} {r['acc_settled']:7.3f} {r.get('frac_zero_std_groups', float('nan')):6.2f}")
    if args.seeds > 1:
        for name, _, _ in arms:
            rs = [r for r in results["runs"].values() if r["arm"] == name]
            print(f"{name + ' (mean)':24s} P {_mean([r['precision'] for r in rs]):.3f}  "
                  f"R {_mean([r['recall'] for r in rs]):.3f}  P(fake) {_mean([r['p_fake'] for r in rs]):.3f}")
    print(f"({results['seconds']} s; n_train={len(train)}, n_test={len(test)}; results in {out / 'results.json'})")


if __name__ == "__main__":
    main()
