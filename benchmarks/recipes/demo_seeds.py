"""The demo's claim over training seeds (recipe ``demo_seeds.yaml``): each stage of the main job adds
something on held-out episodes, base < SFT < GRPO, with intervals that hold across seeds.

One ``closedloop demo`` run per seed (the built-in ``demo`` recipe itself, nested, in
``<out>/seed-<k>``: its own ``recipe.json``, store and plot; a re-run resumes each), the seed
setting the tiny model's build, SFT's data order and GRPO's sampling; every run is evaluated on the
same held-out episodes (``eval_seed_start``), so stages are compared within a seed. Reported per
stage: the mean over seeds of held-out success with a Student-t 95% interval over the per-seed
means; per step (SFT - base, GRPO - SFT): the mean paired difference with its t-interval. The
claim holds when both differences' intervals lie above 0. The between-seed spread is the whole
error bar: the episodes' binomial noise is inside each seed's mean, and a t-interval over
``n`` seeds is wide for small ``n`` (t(0.975, 2) = 4.30), which is the point.

    closedloop recipe run benchmarks/recipes/demo_seeds.yaml                        # seeds 0,1,2
    closedloop recipe run benchmarks/recipes/demo_seeds.yaml --set 'demo={sft_steps: 250}'

Measured so far (single seeds; no multi-seed run yet)
----------------------------------------------------
Why SFT adds nothing with the demo's defaults: ``calc`` level 1 *is* the tiny model's warm-up
task (same templates, same tools, same answer form; ``closedloop.evals.envs.calc``), so the base
has already imitated about 1500 x 8 x 0.45 ~ 5,400 examples of exactly the expert's data before
SFT shows it 12 x 16 = 192 more: the issue's 0.575 -> 0.570. SFT does add when the base has not
been trained to saturation on the task, but GRPO from such an SFT model then collapses. One seed
(0), greedy, held-out seeds from 10,000,000, base = the 500-step tiny model (``CLOSEDLOOP_TINY_MODEL``)::

    closedloop demo --set model=hf:$TINY --set sft_steps=60 --set grpo_steps=1 --set eval_episodes=100
      base 0.020 [0.006, 0.070]   SFT (60 steps, 200 experts) 0.090 [0.048, 0.162]          (Wilson 95%)
    closedloop demo --set model=hf:$TINY --set sft_steps=250 --set expert_episodes=1000 --set grpo_steps=60
      base 0.030 [0.014, 0.064]   SFT 0.385 [0.320, 0.454]   GRPO 0.045 [0.024, 0.083]      (200 episodes)

GRPO (lr 3e-4, as the demo) from the 250-step SFT model: training success 0.33 at step 1, 0.05 by
step 12-18, then a policy that answers at once without a tool call (mean turns 1.00): a wrong
guess earns format 0.1 - turn cost 0.01 = 0.09, a wrong two-turn tool answer 0.08, and in groups
where every episode fails, group-std scaling turns that 0.01 into a full-size advantage. With
``--set grpo.grpo.scale_rewards=none`` (Dr. GRPO) training success fell the same way over the
first 12 steps (0.33 -> 0.08) before the run was stopped. Without the turn cost in GRPO's
environment the guessing goes (mean turns stay 2.00) but GRPO still does not add (30 steps,
100 held-out episodes: SFT 0.420 [0.328, 0.518], GRPO 0.360 [0.273, 0.458]; training success
0.39 at step 3, 0.06-0.25 after)::

    closedloop demo --set model=hf:$TINY --set sft_steps=1 --set expert_episodes=8 --set grpo_steps=30 \
        --set eval_episodes=100 --set grpo.grpo.model=SFT_DIR --set eval.models.sft=SFT_DIR \
        --set grpo.grpo.env_options.turn_cost=0          # SFT_DIR: the 250-step SFT model above

Neither a lower GRPO learning rate (1e-4, turn cost 0, same SFT model: SFT 0.420, GRPO 0.390
[0.300, 0.488]) nor a shorter SFT (100 steps: SFT 0.110 [0.063, 0.186], GRPO 0.080 [0.041, 0.150],
lr 3e-4, turn cost 0) made GRPO add within 30 steps (all one seed, 100 held-out episodes). So no
setting was found where base < SFT < GRPO; the demo's defaults are left as they were (there GRPO
adds, SFT does not), and the seeds run above has not been made: 3 seeds x ~10 minutes did not fit
the shared machine (load 10-27) before the deadline. Three seeds with this recipe (commit 0edef77; base = the 500-step tiny model for every seed,
SFT 250 steps on 1000 experts, GRPO 1 step, 200 held-out episodes; Student t 95%)::

    closedloop recipe run benchmarks/recipes/demo_seeds.yaml --set results_dir=OUT \
        --set 'demo={model: "hf:'$TINY'", expert_episodes: 1000, sft_steps: 250, grpo_steps: 1, eval_episodes: 200}'
      base 0.030 (all seeds)   SFT 0.452 [0.226, 0.677] (0.385, 0.555, 0.415)
      SFT - base +0.422 [+0.196, +0.647]        GRPO(1 step) - SFT -0.055 [-0.100, -0.010]

The SFT step holds across seeds here. A single GRPO update already lowers success in every seed:
a sign that the first AdamW step (about lr = 3e-4 on every weight, whatever the gradient's size)
perturbs the sharpened SFT model; a GRPO warm-up of the learning rate is the next thing to try
(not tried). The failures it leaves are copying errors (``multiply(14, 20)`` returns 280.0, the answer says
250.0; ``9 times 5`` becomes ``multiply(9, 7)``): the 150k-parameter model's number copying, which
the 1500-step base does better (0.575) than 500 warm-up steps + 250 SFT steps (0.385-0.420).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from closedloop.trainers.recipes import StageContext, StageKind

STAGES = ("base", "sft", "grpo")
STEPS = (("sft", "base"), ("grpo", "sft"))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DemoRun(_Strict):
    """One seed: the built-in demo recipe with ``params`` and this seed, into ``out``."""

    seed: int
    out: str
    params: dict[str, Any] = Field(default_factory=dict, description="The demo's params (closedloop demo --list-keys).")


def _demo_run(config: DemoRun, ctx: StageContext) -> dict[str, Any]:
    from closedloop.trainers.recipes import DEMO, StageInterrupted, run_recipe

    done = run_recipe(DEMO, params={**config.params, "seed": config.seed, "out": config.out}, quick=ctx.quick)
    if done.interrupted:
        raise StageInterrupted(f"the demo of seed {config.seed} stopped; run again to continue")
    record = json.loads((Path(config.out) / "recipe.json").read_text())
    results = json.loads(Path(done.outputs["report"]["results"]).read_text())
    return {"seed": config.seed, "results": done.outputs["report"]["results"],
            "success": {s["name"]: s["summary"]["success"] for s in results["stages"]},
            "episodes": results["stages"][0]["summary"]["episodes"],
            "stages": {name: {k: r.get(k) for k in ("commit", "dirty", "config_hash", "seeds", "seconds")}
                       for name, r in record["stages"].items()}}


DEMO_RUN = StageKind(DemoRun, _demo_run, "the demo recipe for one seed")


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and Student-t interval of ``values`` (independent per-seed numbers); one value: no interval."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf(0.5 + level / 2, len(values) - 1)) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


class Report(_Strict):
    runs: dict[str, dict[str, Any]] = Field(..., description="Earlier stages' outputs by name (seed-<k>).")
    seeds: list[int] = Field(..., min_length=1, description="The seeds to report.")
    params: dict[str, Any] = Field(default_factory=dict, description="The demo's params.")
    results_dir: str = Field(..., description="Where results.json, results.md and demo_seeds.png go.")
    command: str = ""


def _row(values: list[float]) -> dict[str, Any]:
    mean, low, high = t_interval(values)
    return {"mean": mean, "ci_low": low, "ci_high": high, "per_seed": values}


def _report(config: Report, ctx: StageContext) -> dict[str, Any]:
    runs = [config.runs[f"seed-{s}"] for s in config.seeds]
    stages = {s: _row([r["success"][s] for r in runs]) for s in STAGES}
    steps = {f"{a}-{b}": _row([r["success"][a] - r["success"][b] for r in runs]) for a, b in STEPS}
    holds = len(runs) >= 2 and all(step["ci_low"] > 0 for step in steps.values())
    out = {"claim": "each stage of closedloop demo adds held-out success: base < SFT < GRPO",
           "interval": "Student t 95% over per-seed means (paired differences for the steps)",
           "seeds": [r["seed"] for r in runs], "episodes_per_stage": runs[0]["episodes"] if runs else 0,
           "stages": stages, "steps": steps, "holds": holds, "params": config.params, "command": config.command,
           "commits": sorted({str(s["commit"]) for r in runs for s in r["stages"].values()}),
           "dirty": any(s["dirty"] for r in runs for s in r["stages"].values()),
           "runs": runs}
    folder = Path(config.results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    (folder / "results.md").write_text(_markdown(out))
    _plot(out, folder / "demo_seeds.png")
    ctx.log(_markdown(out))
    return {"results": str(folder / "results.json"), "holds": holds}


def _fmt(row: dict[str, Any], sign: str = "") -> str:
    return f"{row['mean']:{sign}.3f} [{row['ci_low']:{sign}.3f}, {row['ci_high']:{sign}.3f}]"


def _markdown(out: dict[str, Any]) -> str:
    seeds = out["seeds"]
    lines = [f"Held-out success, calc, {out['episodes_per_stage']} greedy episodes per stage and seed; "
             f"mean over seeds {seeds} with {out['interval']}.", "",
             "| stage | success | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|---|" + "---|" * len(seeds)]
    for name, row in [*out["stages"].items(), *out["steps"].items()]:
        sign = "+" if "-" in name else ""
        lines.append(f"| {name} | {_fmt(row, sign)} | " + " | ".join(f"{v:{sign}.3f}" for v in row["per_seed"]) + " |")
    lines += ["", f"Claim: {out['claim']}. Holds (both steps' intervals above 0): **{'yes' if out['holds'] else 'no'}**.",
              f"Commit(s): {', '.join(out['commits'])}{' (with uncommitted changes)' if out['dirty'] else ''}.",
              f"Command: `{out['command']}`; demo params over its defaults: `{json.dumps(out['params'])}`.", ""]
    return "\n".join(lines)


def _plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for i, (name, row) in enumerate(out["stages"].items()):
        err = [[row["mean"] - row["ci_low"]], [row["ci_high"] - row["mean"]]] if len(row["per_seed"]) > 1 else None
        ax.bar(i, row["mean"], yerr=err, capsize=6, color=["#999999", "#4c72b0", "#dd8452"][i], alpha=0.8)
        ax.scatter([i] * len(row["per_seed"]), row["per_seed"], color="black", s=12, zorder=3)
    ax.set_xticks(range(len(out["stages"])), list(out["stages"]))
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out success")
    ax.set_title(f"closedloop demo, seeds {out['seeds']} (t 95% CI; dots: seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


REPORT = StageKind(Report, _report, "per-stage means and paired steps over seeds, t-intervals")
