"""The report stage of the paper-effect recipes (issue 29): seed replicates in, a verdict out.

Each paper recipe (``ziprerank.yaml``, ``ag_repa.yaml``; the others of issue 29 can reuse it)
runs one stage per training seed. A seed is a whole replicate: fresh synthetic data, a fresh
held-out set, fresh initialisations, every arm trained and evaluated on that seed's data. Each
such stage returns::

    {"seed": 3,
     "metrics": {"<arm>": {"<metric>": 0.71, ...}, ...},              # held-out numbers
     "curves": {"<curve>": {"x": [...], "arms": {"<arm>": [...]}}},    # optional, y per x (any series)
     "info": {...}, "cpu_s": 41.2}                                     # anything else; CPU seconds

and this stage (kind ``paper_report.py:REPORT``) turns the replicates into:

* per arm and metric: the mean over seeds with a 95% Student-t interval over the seeds (so the
  interval is the spread between replicates, data, held-out set and initialisation together);
* per comparison (arm vs baseline on one metric): the paired per-seed differences, their mean and
  t interval, and a verdict. ``claim: better``: *yes* when the interval lies on the better side
  of 0, *no* when it lies on the worse side, *unresolved* when it spans 0. ``claim: not_worse``
  (a "matches" claim) with ``margin`` m: *yes* when the interval's worse end is within m, *no*
  when the whole interval is worse by more than m;
* ``results.json`` (the numbers, per-seed values, the verdicts, and the provenance: the code's
  commit, whether tracked files differed, every stage's config hash and seeds, read from the
  runner's ``recipe.json``), ``results.md`` (the tables) and ``<paper>.png`` (bars with intervals
  and per-seed points, one panel per metric, and one panel per curve with its interval band),
  all in ``results_dir`` (``docs/results/<paper>`` for the committed full runs).

Why Student t over seeds and not a bootstrap over test items: the claims are about training
methods, and a method's variance between training runs is usually larger than the test-set
sampling noise inside one run; with n seeds the t interval is the standard small-sample interval
for a mean of n independent replicates (scipy's ``t.ppf``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import statistics
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from closedloop.trainers.recipes import StageContext, StageKind

LEVEL = 0.95


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Metric(_Strict):
    key: str
    label: str = ""
    better: Literal["higher", "lower"] = "higher"


class Comparison(_Strict):
    metric: str = Field(..., description="A metric key.")
    arm: str
    baseline: str
    claim: Literal["better", "not_worse"] = "better"
    margin: float = Field(0.0, ge=0.0, description="not_worse: how much worse still counts as matching.")
    primary: bool = Field(False, description="The paper's headline claim (the README row).")


class Curve(_Strict):
    key: str
    title: str
    xlabel: str
    ylabel: str


class Report(_Strict):
    paper: str = Field(..., description="Short name: the results folder and the plot's name.")
    title: str
    claim: str = Field(..., description="The paper's claim as tested here, in a sentence.")
    scale: str = Field(..., description="What the toy is, in a sentence (it is a toy: say so).")
    prefix: str = Field("seed-", description="The seed stages: every earlier stage whose name starts with this.")
    arms: dict[str, str] = Field(..., description="Arm key -> label, in table order.")
    metrics: list[Metric]
    comparisons: list[Comparison] = []
    curves: list[Curve] = []
    results_dir: str
    command: str = Field(..., description="The command that regenerates the results.")
    params: dict[str, Any] = {}


# --------------------------------------------------------------------------- statistics


def t_interval(values: list[float], level: float = LEVEL) -> dict[str, Any]:
    """Mean and Student-t interval of independent replicates (no interval from fewer than 2)."""
    from scipy.stats import t

    vals = [float(v) for v in values]
    mean = statistics.fmean(vals) if vals else float("nan")
    if len(vals) < 2:
        return {"mean": mean, "low": None, "high": None, "n": len(vals), "per_seed": vals}
    half = float(t.ppf(0.5 + level / 2, len(vals) - 1)) * statistics.stdev(vals) / math.sqrt(len(vals))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(vals), "per_seed": vals}


def verdict(diff: dict[str, Any], better: str, claim: str, margin: float) -> str:
    """yes / no / unresolved for a paired difference (arm - baseline) and the claim's direction."""
    if diff["low"] is None:
        return "unresolved"
    sign = 1.0 if better == "higher" else -1.0
    worst, best = sorted((sign * diff["low"], sign * diff["high"]))  # the improvement's interval
    bar = 0.0 if claim == "better" else -margin
    if worst > bar:
        return "yes"
    if best < bar:
        return "no"
    return "unresolved"


# --------------------------------------------------------------------------- provenance


def _relative(path: str | None) -> str | None:
    """A path as the repository sees it (no absolute paths of this machine in committed files)."""
    if not path:
        return path
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return p.name


def provenance(out: Path, params: dict[str, Any], stage_names: list[str]) -> dict[str, Any]:
    """Commit, dirty flag, config hashes and seeds of the stages, from the runner's recipe.json."""
    state = json.loads((out / "recipe.json").read_text())
    records = {k: v for k, v in state.get("stages", {}).items() if v.get("status") == "completed"}
    hashes = {k: v.get("config_hash") for k, v in records.items()}
    commits = sorted({str(v.get("commit")) for v in records.values()})
    digest = hashlib.sha256(json.dumps({"params": params, "stages": hashes}, sort_keys=True,
                                       default=str).encode()).hexdigest()[:16]
    return {"recipe": state.get("recipe"), "source": _relative(state.get("source")),
            "commit": commits[0] if len(commits) == 1 else commits,
            "dirty": any(bool(v.get("dirty")) for v in records.values()),
            "config_hash": digest, "stage_config_hashes": hashes,
            "seeds": {k: records[k].get("seeds", {}) for k in stage_names if k in records},
            "params": params}


def _cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# --------------------------------------------------------------------------- outputs


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _cell(s: dict[str, Any]) -> str:
    return f"{_fmt(s['mean'])} [{_fmt(s['low'])}, {_fmt(s['high'])}]"


def markdown(result: dict[str, Any], config: Report) -> str:
    prov = result["provenance"]
    lines = [f"# {config.title}", "", f"**Claim tested.** {config.claim}", "", f"**Scale.** {config.scale}", "",
             f"Held-out numbers: mean over {result['n_seeds']} training seeds [95% Student-t interval over the "
             "seeds]. Each seed is a full replicate: fresh synthetic data, held-out set and initialisation.", "",
             "| arm | " + " | ".join(m.label or m.key for m in config.metrics) + " |",
             "|---|" + "---|" * len(config.metrics)]
    for arm, label in config.arms.items():
        lines.append(f"| {label} | " + " | ".join(_cell(result["arms"][arm][m.key]) for m in config.metrics) + " |")
    if result["comparisons"]:
        lines += ["", "| comparison | metric | difference (arm - baseline) [95% CI] | claim | holds? |",
                  "|---|---|---|---|---|"]
        for c in result["comparisons"]:
            claim = c["claim"] if c["claim"] == "better" else f"not worse by more than {c['margin']:g}"
            lines.append(f"| {config.arms[c['arm']]} vs {config.arms[c['baseline']]}{' (headline)' if c['primary'] else ''}"
                         f" | {c['metric_label']} ({c['better']} is better) | {_cell(c['difference'])} | {claim} | "
                         f"{c['holds']} |")
    lines += ["", f"Plot: `{config.paper}.png`. Regenerate: `{config.command}` (from the repository root; "
              "`--quick` checks the recipe, not the effect).", "",
              f"Commit {prov['commit']}{' (tracked files differed)' if prov['dirty'] else ''}, config hash "
              f"{prov['config_hash']}, seeds {result['seeds']}; {result['cpu_s']:.0f} s CPU in the seed stages, "
              f"load average {result['load']:.1f} at the end.", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], config: Report, path: Path) -> None:
    """One panel per metric (mean and interval per arm, per-seed points beside), one per curve
    (mean with its interval band), and the comparisons' paired differences (improvement > 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(config.metrics) + len(config.curves) + bool(result["comparisons"])
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.9 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    arms = list(config.arms)
    flat = list(axes.flat)
    for ax, metric in zip(flat, config.metrics):
        for i, arm in enumerate(arms):
            s = result["arms"][arm][metric.key]
            colour = colours[i % len(colours)]
            if s["low"] is not None:
                ax.errorbar(i, s["mean"], yerr=[[s["mean"] - s["low"]], [s["high"] - s["mean"]]], color=colour,
                            capsize=5, marker="o", markersize=7)
            else:
                ax.plot(i, s["mean"], "o", color=colour, markersize=7)
            ax.scatter([i + 0.18] * len(s["per_seed"]), s["per_seed"], color=colour, s=10, alpha=0.6)
        ax.set_xticks(range(len(arms)), [config.arms[a] for a in arms], rotation=20, ha="right", fontsize=8)
        ax.set_xlim(-0.5, len(arms) - 0.3)
        ax.set_title(f"{metric.label or metric.key} ({metric.better} is better)", fontsize=9)
    for ax, curve in zip(flat[len(config.metrics):], config.curves):
        data = result["curves"][curve.key]
        for i, (arm, s) in enumerate(data["arms"].items()):
            colour = colours[(arms.index(arm) if arm in arms else len(arms) + i) % len(colours)]
            ax.plot(data["x"], s["mean"], marker="o", color=colour, label=config.arms.get(arm, arm))
            if all(v is not None for v in s["low"]):
                ax.fill_between(data["x"], s["low"], s["high"], color=colour, alpha=0.2)
        ax.set_xlabel(curve.xlabel)
        ax.set_ylabel(curve.ylabel)
        ax.set_title(curve.title, fontsize=9)
        ax.legend(fontsize=7)
    if result["comparisons"]:
        ax = flat[len(config.metrics) + len(config.curves)]
        for i, c in enumerate(result["comparisons"]):
            d, sign = c["difference"], 1.0 if c["better"] == "higher" else -1.0
            mean = sign * d["mean"]
            if d["low"] is not None:
                lo, hi = sorted((sign * d["low"], sign * d["high"]))
                ax.errorbar(mean, i, xerr=[[mean - lo], [hi - mean]], fmt="o", color="black", capsize=4)
            else:
                ax.plot(mean, i, "o", color="black")
            if c["claim"] == "not_worse":
                ax.plot(-c["margin"], i, "|", color="red", markersize=14)
        ax.axvline(0, color="grey", linewidth=1)
        ax.set_yticks(range(len(result["comparisons"])),
                      [f"{config.arms[c['arm']]} vs {config.arms[c['baseline']]}\n{c['metric_label']}"
                       for c in result["comparisons"]], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("improvement over the baseline (> 0: better), paired by seed")
        ax.set_title("comparisons (95% t intervals)", fontsize=9)
    for ax in flat[panels:]:
        ax.axis("off")
    fig.suptitle(f"{config.title} ({result['n_seeds']} seeds, 95% t intervals)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # never a half-written results file


def summarise(config: Report, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The result document (without provenance) from the seed stages' outputs."""
    if not runs:
        raise ValueError(f"no finished stage named {config.prefix}*: nothing to report")
    names = list(runs)
    metric_keys = {m.key: m for m in config.metrics}
    arms: dict[str, dict[str, Any]] = {}
    for arm in config.arms:
        arms[arm] = {}
        for key in metric_keys:
            missing = [n for n in names if key not in runs[n].get("metrics", {}).get(arm, {})]
            if missing:
                raise ValueError(f"stage(s) {missing} report no metric {key!r} for arm {arm!r}")
            arms[arm][key] = t_interval([runs[n]["metrics"][arm][key] for n in names])
    comparisons = []
    for c in config.comparisons:
        if c.metric not in metric_keys or c.arm not in config.arms or c.baseline not in config.arms:
            raise ValueError(f"comparison {c.arm} vs {c.baseline} on {c.metric}: unknown metric or arm")
        m = metric_keys[c.metric]
        diff = t_interval([runs[n]["metrics"][c.arm][c.metric] - runs[n]["metrics"][c.baseline][c.metric]
                           for n in names])
        comparisons.append({**c.model_dump(), "metric_label": m.label or m.key, "better": m.better,
                            "difference": diff, "holds": verdict(diff, m.better, c.claim, c.margin)})
    curves: dict[str, Any] = {}
    for curve in config.curves:
        xs = runs[names[0]]["curves"][curve.key]["x"]
        per_arm: dict[str, Any] = {}
        for arm in runs[names[0]]["curves"][curve.key]["arms"]:  # the arms, or any other series
            points = [t_interval([runs[n]["curves"][curve.key]["arms"][arm][i] for n in names]) for i in range(len(xs))]
            per_arm[arm] = {k: [p[k] for p in points] for k in ("mean", "low", "high")}
        curves[curve.key] = {"x": xs, "arms": per_arm}
    return {"paper": config.paper, "title": config.title, "claim": config.claim, "scale": config.scale,
            "command": config.command, "n_seeds": len(names), "seeds": [runs[n].get("seed") for n in names],
            "interval": f"{LEVEL:.0%} Student t over seeds", "arms": arms, "comparisons": comparisons,
            "curves": curves, "info": {n: runs[n].get("info", {}) for n in names},
            "cpu_s": sum(float(runs[n].get("cpu_s", 0.0)) for n in names)}


def _report(config: Report, ctx: StageContext) -> dict[str, Any]:
    runs = {name: out for name, out in ctx.outputs.items() if name.startswith(config.prefix)}
    result = summarise(config, runs)
    result["provenance"] = provenance(ctx.out, config.params, list(runs))
    result["load"] = os.getloadavg()[0]
    result["process_cpu_s"] = _cpu_seconds()
    folder = Path(config.results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    plot(result, config, folder / f"{config.paper}.png")
    _write(folder / "results.json", json.dumps(result, indent=1, default=str) + "\n")
    _write(folder / "results.md", markdown(result, config))
    for c in result["comparisons"]:
        d = c["difference"]
        ctx.log(f"{config.arms[c['arm']]} vs {config.arms[c['baseline']]} on {c['metric_label']}: "
                f"{_cell(d)} -> holds: {c['holds']}")
    return {"results": str(folder / "results.json"), "markdown": str(folder / "results.md"),
            "plot": str(folder / f"{config.paper}.png"),
            "holds": {f"{c['arm']}-vs-{c['baseline']}:{c['metric']}": c["holds"] for c in result["comparisons"]}}


REPORT = StageKind(Report, _report, "seed replicates -> intervals, verdicts, results.json/.md and a plot")
