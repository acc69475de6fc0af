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

    closedloop recipe run benchmarks/recipes/factguard_risk.yaml --set out=out/factguard_risk   # defaults: no effect, see below
    closedloop recipe run benchmarks/recipes/factguard_risk.yaml --quick --set out=/tmp/fg_quick # mechanics only

(The pipeline is the recipe ``factguard_risk.yaml`` beside this module, which holds its data,
evaluation and report stages. The commands below predate the recipe: every flag of
``python benchmarks/exp_factguard_risk.py`` is now a param of the same name, dashes as
underscores, e.g. ``--set samples=900 --set sft_steps=600 --set weights=1:4,4:1,1:1``; a bare flag
such as ``--full-agent`` is ``--set full_agent=true``; ``--sft-from DIR`` is ``--set sft_from=DIR``.
SFT and GRPO runs are recorded in ``<out>/runs.duckdb``.)

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

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from closedloop.trainers.recipes import StageContext, StageKind

SYSTEM_PROMPT = ("Is the video real or fake? Reply <think>why</think><answer>real</answer> or "
                 "<answer>fake</answer>.")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Data(_Strict):
    """The synthetic data, the environment options, and the arms (one GRPO run per weight and seed)."""

    samples: int
    weights: str
    seeds: int
    unsettled_fake: float
    full_agent: bool


def _data(config: Data, ctx: StageContext) -> dict[str, Any]:
    from closedloop.evals.factguard.data import load_samples, temporal_split
    from closedloop.evals.factguard.synthetic import make_synthetic

    data = ctx.dir
    if not (data / "samples.jsonl").exists():
        make_synthetic(data, n=config.samples, seed=0, evidence_rate=0.5, videos=False)
    train, test = temporal_split(load_samples(data))
    env_options: dict[str, Any] = {"data_dir": str(data), "max_turns": 3}
    if not config.full_agent:  # the tiny model cannot learn the two-stage tool loop on long prompts in minutes
        env_options.update(evidence_in_prompt=True, max_turns=1, search_k=1, system_prompt=SYSTEM_PROMPT)
    teacher = {**env_options, "expert_unsettled_fake": config.unsettled_fake} if config.unsettled_fake else env_options
    runs = []
    for w in config.weights.split(","):
        a, g = (float(x) for x in w.split(":"))
        arm = f"alpha{a:g}_gamma{g:g}"
        for seed in range(config.seeds):
            runs.append({"name": f"{arm}_seed{seed}" if config.seeds > 1 else arm, "arm": arm, "alpha": a, "gamma": g,
                         "seed": seed})
    return {"data_dir": str(data), "n_train": len(train), "n_test": len(test), "env_options": env_options,
            "teacher": teacher, "runs": runs}


DATA = StageKind(Data, _data, "synthetic FactGuard data, environment options and arms")


class Evaluate(_Strict):
    """A policy greedily on the temporal test split; "fake" is the positive class."""

    model_dir: str
    env_options: dict[str, Any]
    n_test: int


def _mean(xs: list[Any]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _evaluate(config: Evaluate, ctx: StageContext) -> dict[str, Any]:
    from closedloop.evals.factguard.data import binary_metrics
    from closedloop.trainers.recipes.stages import EvaluateStage, evaluate_model

    spec = EvaluateStage(models={ctx.name: config.model_dir}, env="factguard",
                         env_options={**config.env_options, "split": "test"}, graph="factguard",
                         episodes=config.n_test, seed_start=0, max_tokens=96)
    _, episodes = evaluate_model(ctx.name, config.model_dir, spec)
    preds = [e.info.get("predicted") for e in episodes]
    labels = [e.info.get("label") for e in episodes]
    m = binary_metrics(preds, labels, bootstrap=500)
    tools = sum(bool(e.info.get("tools_used")) for e in episodes) / len(episodes)
    # Where the decision is made: claims the corpus settles (synthetic doc ids are doc-<sample id>) vs not.
    corpus = Path(config.env_options["data_dir"]) / "corpus.jsonl"
    settled = {json.loads(line)["id"].removeprefix("doc-") for line in corpus.read_text().splitlines() if line}
    unsettled = [e.info.get("predicted") for e in episodes if e.info.get("sample") not in settled]
    right = [e.info.get("predicted") == e.info.get("label") for e in episodes if e.info.get("sample") in settled]
    return {**m.model_dump(), "tool_rate": tools, "p_fake": sum(p == "fake" for p in preds) / len(preds),
            "p_fake_unsettled": _mean([p == "fake" for p in unsettled]), "acc_settled": _mean(right)}


EVALUATE = StageKind(Evaluate, _evaluate, "precision and recall on the test split")


class Report(_Strict):
    results: str
    runs: list[dict[str, Any]]
    seeds: int
    params: dict[str, Any] = {}
    seconds: dict[str, float] = {}


def _report(config: Report, ctx: StageContext) -> dict[str, Any]:
    data = ctx.outputs["data"]
    results: dict[str, Any] = {"sft": ctx.outputs["eval-sft"], "runs": {}, "args": config.params}
    for run in config.runs:
        r = dict(ctx.outputs[f"eval-{run['name']}"])
        # Is there a learning signal? The share of groups whose G answers all scored alike (advantage 0).
        history = ctx.outputs[run["name"]]["history"]
        r["frac_zero_std_groups"] = _mean([h.get("frac_zero_std_groups", float("nan")) for h in history])
        r["arm"], r["seed"] = run["arm"], run["seed"]
        results["runs"][run["name"]] = r
    results["seconds"] = round(sum(config.seconds.values()), 1)
    results["n_train"], results["n_test"] = data["n_train"], data["n_test"]
    Path(config.results).write_text(json.dumps(results, indent=2, default=str))
    print(f"{'policy':24s} {'P [95% CI]':>20s} {'R [95% CI]':>20s} {'F1':>6s} {'Acc':>6s} {'P(fake)':>7s} "
          f"{'P(f|uns)':>8s} {'acc|set':>7s} {'0-std':>6s}")
    for k, r in [("sft", results["sft"])] + list(results["runs"].items()):
        p_ci, r_ci = r["precision_ci"], r["recall_ci"]
        print(f"{k:24s} {r['precision']:6.3f} [{p_ci[0]:.2f},{p_ci[1]:.2f}] {r['recall']:6.3f} "
              f"[{r_ci[0]:.2f},{r_ci[1]:.2f}] {r['f1']:6.3f} {r['accuracy']:6.3f} {r['p_fake']:7.3f} "
              f"{r['p_fake_unsettled']:8.3f} {r['acc_settled']:7.3f} {r.get('frac_zero_std_groups', float('nan')):6.2f}")
    if config.seeds > 1:
        for arm in dict.fromkeys(run["arm"] for run in config.runs):
            rs = [r for r in results["runs"].values() if r["arm"] == arm]
            print(f"{arm + ' (mean)':24s} P {_mean([r['precision'] for r in rs]):.3f}  "
                  f"R {_mean([r['recall'] for r in rs]):.3f}  P(fake) {_mean([r['p_fake'] for r in rs]):.3f}")
    print(f"({results['seconds']} s; n_train={data['n_train']}, n_test={data['n_test']}; results in {config.results})")
    return {"results": config.results}


REPORT = StageKind(Report, _report, "the table and results.json")
