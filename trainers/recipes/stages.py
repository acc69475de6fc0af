"""The built-in stage kinds of recipes: build or load a model, record expert trajectories, SFT,
GRPO, and a held-out evaluation. Each is a typed config (the trainers' own configs as ``sft:`` and
``grpo:`` sub-configs, not copies of their fields) and a function of it and the previous stages'
outputs; each is also callable from Python (``SFT.run(SFTStage(...), ctx)``), so experiments can
compose them in their own stages.

Outputs (what later stages read as ``${stages.<name>.<key>}``):

=============  ==============================================================
``base_model`` ``model_dir``
``experts``    ``path`` (JSONL, one trajectory a line), ``count``
``sft``        ``model_dir``, ``run_id``, ``steps``, ``metrics``
``grpo``       ``model_dir``, ``run_id``, ``steps``, ``history`` (metrics per step)
``evaluate``   ``summaries``: per model, success with its Wilson 95% CI, mean turns, tokens,
               reward, the means of ``extra_keys`` and of each cost (``cost/<name>``)
=============  ==============================================================
"""

from __future__ import annotations

import json
from contextlib import closing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from closedloop.trainers.config import SFTConfig, model_path
from closedloop.trainers.constrained import CostConstraint
from closedloop.trainers.grpo import GRPOConfig
from closedloop.trainers.recipes.runner import StageContext, StageInterrupted, StageKind

__all__ = ["BASE_MODEL", "EXPERTS", "SFT", "GRPO", "EVALUATE", "BaseModelStage", "ExpertsStage", "SFTStage",
           "GRPOStage", "EvaluateStage", "evaluate_model", "read_trajectories"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- base model


class BaseModelStage(_Strict):
    """The model the pipeline starts from."""

    model: str | None = Field(None, description="An existing model (hf:PATH or a directory); null: build the "
                                                "offline tiny model in the stage's folder.")
    tiny_preset: str | None = Field(None, description="Named settings of the tiny model build "
                                                      "(closedloop.models.tiny_presets: agent, test); null: the "
                                                      "plain warm-up data with tiny_steps steps.")
    tiny_steps: int | None = Field(None, ge=0, description="Warm-up steps of the tiny model build (null: the "
                                                           "preset's, or 1500 without one).")
    seed: int = Field(0, description="Seed of the tiny model build.")


def _base_model(config: BaseModelStage, ctx: StageContext) -> dict[str, Any]:
    if config.model:
        return {"model_dir": model_path(config.model)}
    from closedloop.models.tiny import ensure_tiny_model
    from closedloop.models.tiny_presets import preset_settings

    settings = preset_settings(config.tiny_preset) if config.tiny_preset else {"train_steps": 1500}
    if config.tiny_steps is not None:
        settings["train_steps"] = config.tiny_steps
    ctx.log(f"building the tiny model ({config.tiny_preset or 'plain'} data, {settings['train_steps']} warm-up steps)")
    _, how = ensure_tiny_model(ctx.dir, seed=config.seed, **settings)
    if how != "built":
        ctx.log(f"tiny model {'kept' if how == 'kept' else 'copied from the build cache'}: same settings as before")
    return {"model_dir": str(ctx.dir)}


BASE_MODEL = StageKind(BaseModelStage, _base_model, "build the tiny model, or take an existing one")


# --------------------------------------------------------------------------- experts


class ExpertsStage(_Strict):
    """Scripted-expert episodes of a built-in environment, as SFT data."""

    env: str = Field(..., description="Environment (calc, clarify, simul, factguard, ...).")
    episodes: int = Field(..., ge=1, description="Episodes, on seeds seed_start, seed_start + 1, ...")
    seed_start: int = Field(0, description="First episode seed.")
    options: dict[str, Any] = Field(default_factory=dict, description="Environment and expert options "
                                                                      "(level, expert, ...).")
    store: str | None = Field(None, description="Also record them in this run store (kind expert).")
    tags: list[str] = Field(default_factory=list, description="Tags of the recorded trajectories.")


def _experts(config: ExpertsStage, ctx: StageContext) -> dict[str, Any]:
    from closedloop.evals.envs.experts import expert_trajectories

    trajs = expert_trajectories(config.env, range(config.seed_start, config.seed_start + config.episodes),
                                **config.options)
    path = ctx.dir / "experts.jsonl"
    tmp = path.with_name(".experts.jsonl.tmp")
    tmp.write_text("".join(t.model_dump_json() + "\n" for t in trajs))
    tmp.replace(path)
    if config.store:
        from closedloop.store import RunStore

        with closing(RunStore(config.store)) as store:
            store.record_trajectories(trajs, kind="expert", graph="expert", model_spec="expert", tags=config.tags)
    ctx.log(f"experts: {len(trajs)} {config.env} trajectories {json.dumps(config.options)}"
            + (" recorded" if config.store else ""))
    return {"path": str(path), "count": len(trajs)}


def read_trajectories(paths: list[str]) -> list[Any]:
    """The trajectories of JSONL files (an ``experts`` stage's ``path``), in order."""
    from closedloop.messages import Trajectory

    out: list[Any] = []
    for p in paths:
        out.extend(Trajectory.model_validate_json(line) for line in Path(p).read_text().splitlines() if line)
    return out


EXPERTS = StageKind(ExpertsStage, _experts, "scripted-expert episodes as SFT data")


# --------------------------------------------------------------------------- training


def _note_metrics(ctx: StageContext, every: int) -> Any:
    from closedloop.trainers.reporting import format_metrics

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if metrics and step % every == 0:
            ctx.note(f"{ctx.name} step {step}: {format_metrics(metrics)}")
    return on_step


class SFTStage(_Strict):
    """Supervised fine-tuning (:func:`closedloop.trainers.sft.train_sft`)."""

    sft: SFTConfig = Field(..., description="The SFT trainer's config (closedloop train sft --list-keys).")
    trajectories: list[str] = Field(default_factory=list, description="JSONL trajectory files (experts stages' "
                                                                      "path), concatenated; empty: sft.dataset.")


def _sft(config: SFTStage, ctx: StageContext) -> dict[str, Any]:
    from closedloop.trainers.sft import train_sft

    trajs = read_trajectories(config.trajectories) if config.trajectories else None
    result = train_sft(config.sft, trajs, on_step=_note_metrics(ctx, 1))
    if result.interrupted:
        raise StageInterrupted(f"SFT stopped at step {result.step}, checkpoint {result.checkpoint}")
    return {"model_dir": str(result.model_dir), "run_id": result.run_id, "steps": result.step,
            "metrics": result.metrics}


SFT = StageKind(SFTStage, _sft, "supervised fine-tuning")


class GRPOStage(_Strict):
    """Multi-turn GRPO (:func:`closedloop.trainers.grpo.train_grpo`)."""

    grpo: GRPOConfig = Field(..., description="The GRPO trainer's config (closedloop train grpo --list-keys).")


def _grpo(config: GRPOStage, ctx: StageContext) -> dict[str, Any]:
    from closedloop.trainers.grpo import train_grpo

    result = train_grpo(config.grpo, on_step=_note_metrics(ctx, config.grpo.logging_steps))
    if result.interrupted:
        raise StageInterrupted(f"GRPO stopped at step {result.steps}")
    return {"model_dir": str(result.output_dir), "run_id": result.run_id, "steps": result.steps,
            "history": result.history}


GRPO = StageKind(GRPOStage, _grpo, "multi-turn GRPO on rollouts of a graph")


# --------------------------------------------------------------------------- evaluation


class EvaluateStage(_Strict):
    """Each model run by a graph on held-out environment seeds (:func:`closedloop.trainers.evaluate.evaluate`)."""

    models: dict[str, str] = Field(..., description="Label -> model directory (hf:PATH allowed), in table order.")
    env: str = Field(..., description="Environment.")
    env_options: dict[str, Any] = Field(default_factory=dict, description="Its options.")
    graph: str = Field("react", description="The graph that acts.")
    episodes: int = Field(..., ge=1, description="Episodes per model.")
    seed_start: int = Field(..., description="First held-out seed (keep outside the training seeds).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature (0: greedy).")
    max_tokens: int = Field(64, ge=1, description="Tokens per turn.")
    sample_seed: int | None = Field(None, description="Sampling seed (SamplingParams.seed).")
    max_steps: int = Field(8, ge=1, description="Turns per episode before it is truncated.")
    max_batch_size: int = Field(64, ge=1, description="Largest decode batch.")
    extra_keys: list[str] = Field(default_factory=list, description="Also the mean of these episode info keys.")
    costs: list[CostConstraint] = Field(default_factory=list, description="Also the mean episode cost of each.")
    store: str | None = Field(None, description="Record an eval run per model, its episodes as children.")
    tags: list[str] = Field(default_factory=list, description="Tags of the recorded runs (plus stage:<label>).")


def evaluate_model(label: str, model_dir: str, config: EvaluateStage) -> tuple[dict[str, Any], list[Any]]:
    """One model's summary and episodes under ``config`` (recorded in ``config.store`` when set)."""
    from closedloop.evals.envs import make_env
    from closedloop.models.base import SamplingParams
    from closedloop.models.hf import HFClient
    from closedloop.trainers.constrained import episode_cost
    from closedloop.trainers.evaluate import evaluate

    path = model_path(model_dir)
    client = HFClient.from_pretrained(path, max_batch_size=config.max_batch_size)
    seeds = range(config.seed_start, config.seed_start + config.episodes)
    params = SamplingParams(temperature=config.temperature, max_tokens=config.max_tokens, seed=config.sample_seed)
    summary, episodes = evaluate(client, lambda: make_env(config.env, **config.env_options), seeds, name=label,
                                 graph=config.graph, params=params, max_steps=config.max_steps,
                                 extra_keys=config.extra_keys, metadata={"stage": label})
    out = summary.as_dict()
    for c in config.costs:
        out[f"cost/{c.key}"] = sum(episode_cost(c, e.trajectory, e.info) for e in episodes) / max(len(episodes), 1)
    if config.store:
        _record(label, path, config, out, episodes)
    return out, episodes


def _record(label: str, path: str, config: EvaluateStage, summary: dict[str, Any], episodes: list[Any]) -> None:
    from closedloop.store import RunStore

    tags = [*config.tags, f"stage:{label}"]
    spec = f"hf:{path}"
    with closing(RunStore(config.store)) as store:
        parent = store.start_run(kind="eval", graph=config.graph, model_spec=spec,
                                 config={"env": config.env, **config.env_options,
                                         "seeds": [config.seed_start, config.seed_start + config.episodes]},
                                 tags=tags)
        store.record_trajectories([e.trajectory for e in episodes], kind="eval-episode", graph=config.graph,
                                  model_spec=spec, parent_id=parent, tags=tags)
        store.finish_run(parent, "completed", outcome={"rewards": {"success": summary["success"]}, "summary": summary})


def _evaluate(config: EvaluateStage, ctx: StageContext) -> dict[str, Any]:
    summaries = {}
    for label, model_dir in config.models.items():
        summaries[label], _ = evaluate_model(label, model_dir, config)
        s = summaries[label]
        ctx.log(f"evaluated {label}: success {s['success']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}], "
                f"mean reward {s['mean_reward']:.3f}")
    return {"summaries": summaries}


EVALUATE = StageKind(EvaluateStage, _evaluate, "held-out evaluation of each model")
