"""FactGuard's risk weights move precision and recall (paper 1, checkable (c)): a small local experiment.

Synthetic FactGuard data (half the claims settled by the corpus, half ambiguous), the tiny model,
SFT on teacher trajectories (answer from the FactProbe report; "real" when it does not settle the
claim), then GRPO with the decision-aware reward in two arms from the same SFT model, same seeds and steps, differing only in
α:γ (1:2, where missing a fake costs more, and 2:1, where flagging a real video costs more). Each
policy is evaluated greedily on the temporal test split; "fake" is the positive class.

By default the FactProbe report on the claim is put in the prompt and the policy answers once
(``evidence_in_prompt``): the 150k-parameter model does not learn the two-stage tool loop on
650-token prompts in minutes of CPU; ``--full-agent`` runs the whole agent for a real model.

The paper's claim: raising α relative to γ raises precision and lowers recall
(FakeSV: 1:2 → P/R 80.8/82.1; 2:1 → 83.2/75.0).

    python benchmarks/exp_factguard_risk.py --out out/factguard_risk          # ~15-30 min on 2 CPUs
    python benchmarks/exp_factguard_risk.py --quick --out /tmp/fg_quick       # mechanics only
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
    return {**m.model_dump(), "tool_rate": tools}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/factguard_risk")
    ap.add_argument("--model", help="base checkpoint dir (default: build the tiny model)")
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--weights", default="1:2,2:1",
                    help="the two arms' alpha:gamma (comma-separated; the paper's Table 2 uses 1:2 and 2:1)")
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
    experts = expert_trajectories("factguard", range(len(train)), **env_options)
    sft = train_sft(SFTConfig(model=str(base), output_dir=str(out / "sft"), max_steps=args.sft_steps,
                              learning_rate=3e-3, lr_scheduler="cosine", warmup_steps=max(1, args.sft_steps // 20),
                              per_device_batch_size=16, seed=0, save_steps=None, save_total_limit=1,
                              torch_threads=1, logging_steps=max(1, args.sft_steps // 5), run_name="fg-sft"), experts)
    results = {"sft": evaluate_arm(Path(sft.output_dir), env_options, len(test))}
    arms = []
    for w in args.weights.split(","):
        a, g = (float(x) for x in w.split(":"))
        arms.append((f"alpha{a:g}_gamma{g:g}", a, g))
    for name, alpha, gamma in arms:
        opts = {**env_options, "reward": {"alpha": alpha, "gamma": gamma}}
        grpo = train_grpo(GRPOConfig(model=str(sft.output_dir), output_dir=str(out / name), env="factguard",
                                     env_options=opts, graph="factguard", max_steps=args.grpo_steps,
                                     learning_rate=3e-4, lr_scheduler="constant", prompts_per_step=8,
                                     num_generations=8, temperature=1.0, loss_type="dapo", train_seed_start=0,
                                     per_device_batch_size=16, seed=0, save_steps=None, save_total_limit=1,
                                     torch_threads=1, logging_steps=max(1, args.grpo_steps // 5), run_name=name))
        results[name] = evaluate_arm(Path(grpo.output_dir), env_options, len(test))
    results["seconds"] = round(time.perf_counter() - t0, 1)
    results["n_train"], results["n_test"] = len(train), len(test)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"{'policy':16s} {'P':>6s} {'R':>6s} {'F1':>6s} {'Acc':>6s} {'tools':>6s}")
    for k in ["sft"] + [name for name, _, _ in arms]:
        r = results[k]
        print(f"{k:16s} {r['precision']:6.3f} {r['recall']:6.3f} {r['f1']:6.3f} {r['accuracy']:6.3f} "
              f"{r['tool_rate']:6.2f}")
    print(f"({results['seconds']} s; n_train={len(train)}, n_test={len(test)}; results in {out / 'results.json'})")


if __name__ == "__main__":
    main()
