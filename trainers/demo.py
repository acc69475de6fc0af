"""``closedloop demo``: the whole loop on one machine — build, imitate, reinforce, evaluate.

The pipeline is the built-in recipe ``trainers/recipes/demo.yaml`` (``closedloop recipe run demo``
runs the same): the tiny model (or ``--model hf:PATH``), expert ``calc`` trajectories, SFT on them,
multi-turn GRPO from the SFT model on rollouts of the ``react`` graph, and a greedy evaluation of
base, SFT and GRPO on held-out seeds. This module holds what is the demo's own: its last stage,
which writes ``results.json`` (:class:`DemoResult`) and ``demo.png`` (:func:`plot`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from closedloop.trainers.recipes.runner import StageContext, StageKind

__all__ = ["DemoReport", "DemoResult", "REPORT", "StageResult", "plot", "run_demo"]


class StageResult(BaseModel):
    name: str
    model_dir: str
    summary: dict[str, Any]


class DemoResult(BaseModel):
    """``results.json``: each policy's held-out summary, the GRPO metrics per step, where it all went."""

    stages: list[StageResult]
    grpo_history: list[dict[str, float]]
    store: str
    plot: str | None
    seconds: dict[str, float]


class DemoReport(BaseModel):
    """The demo's last stage: ``results.json`` and ``demo.png`` from the earlier stages' outputs."""

    model_config = ConfigDict(extra="forbid")

    results: str = Field(..., description="Where results.json goes.")
    plot: str = Field(..., description="Where the PNG goes.")
    models: dict[str, str] = Field(..., description="Stage name -> model directory, in table order.")
    summaries: dict[str, dict[str, Any]] = Field(..., description="Stage name -> evaluation summary.")
    grpo_history: list[dict[str, float]] = Field(..., description="GRPO metrics per step.")
    store: str = Field(..., description="The run store.")
    seconds: dict[str, float] = Field(default_factory=dict, description="Time per part of the pipeline.")


def plot(result: DemoResult, path: Path) -> Path:
    """Two panels: GRPO reward (and success) per step; held-out success per stage with 95% CIs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [h["step"] for h in result.grpo_history]
    for key, label, colour in (("reward", "mean reward", "#4c72b0"), ("rewards/success", "success", "#dd8452")):
        ys = [h.get(key, 0.0) for h in result.grpo_history]
        a.plot(steps, ys, color=colour, alpha=0.3, linewidth=1)
        window = max(1, len(ys) // 6)  # each step sees new seeds: the trend is what shows learning
        smooth = [sum(ys[max(0, i - window + 1):i + 1]) / len(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
        a.plot(steps, smooth, color=colour, linewidth=2, label=f"{label} (train rollouts, {window}-step mean)")
    a.set_xlabel("GRPO step")
    a.set_title("GRPO on rollouts of the react graph")
    a.legend()
    names = [s.name for s in result.stages]
    succ = [s.summary["success"] for s in result.stages]
    err = [[s.summary["success"] - s.summary["ci_low"] for s in result.stages],
           [s.summary["ci_high"] - s.summary["success"] for s in result.stages]]
    b.bar(names, succ, yerr=err, capsize=6, color=["#999999", "#4c72b0", "#dd8452"][: len(names)])
    b.set_ylim(0, 1)
    b.set_ylabel("success on held-out seeds")
    b.set_title("Held-out success (95% Wilson CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _report(config: DemoReport, ctx: StageContext) -> dict[str, Any]:
    result = DemoResult(stages=[StageResult(name=k, model_dir=v, summary=config.summaries[k])
                                for k, v in config.models.items()],
                        grpo_history=config.grpo_history, store=config.store, plot=None, seconds=config.seconds)
    result.plot = str(plot(result, Path(config.plot)))
    Path(config.results).write_text(result.model_dump_json(indent=2))
    return {"results": config.results, "plot": result.plot}


REPORT = StageKind(DemoReport, _report, "results.json and demo.png")


def run_demo(params: dict[str, Any] | None = None, *, quick: bool = False, console: Any = None) -> DemoResult | None:
    """Run the demo recipe with ``params`` (its knobs: ``closedloop demo --list-keys``) and return
    what ``results.json`` holds (None when a Ctrl-C stopped it; running it again continues)."""
    from closedloop.trainers.recipes import DEMO, run_recipe

    done = run_recipe(DEMO, params=params, quick=quick, console=console)
    if done.interrupted:
        return None
    return DemoResult.model_validate_json(Path(done.outputs["report"]["results"]).read_text())
