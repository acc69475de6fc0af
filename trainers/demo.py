"""``closedloop demo``: the whole loop on one machine — build, imitate, reinforce, evaluate.

1. the base model: the offline tiny model (built here) or ``--model hf:PATH``;
2. expert trajectories of the ``calc`` environment (scripted expert, recorded in the store);
3. SFT on them (:func:`closedloop.trainers.sft.train_sft`);
4. multi-turn GRPO from the SFT model, rollouts running the ``react`` graph
   (:func:`closedloop.trainers.grpo.train_grpo`);
5. base, SFT and GRPO policies evaluated greedily on held-out seeds (never used for training):
   success with Wilson 95% intervals, mean turns, tokens; a table, ``results.json`` and a PNG
   (GRPO reward curve; success per stage). Every run — experts, SFT, GRPO and its rollouts, each
   evaluation episode — lands in the run store.

Seeds: experts use ``[0, expert_episodes)``, GRPO draws from ``[grpo_seed_start, +1e6)`` and
evaluation uses ``[eval_seed_start, +eval_episodes)``, disjoint ranges.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field


class DemoConfig(BaseModel):
    """Every knob of the demo; the defaults fit a 2-core CPU in about 10 minutes."""

    model_config = ConfigDict(extra="forbid")

    out: str = Field("out/demo", description="Output folder (models, results.json, demo.png).")
    store: str | None = Field(None, description="Run store file (default: <out>/runs.duckdb).")
    model: str | None = Field(None, description="Base model as hf:PATH; default: build the tiny model.")
    tiny_steps: int = Field(1500, ge=0, description="Warm-up steps of the tiny model build (1500: the base copies numbers "
                                                  "into tool calls about a third of the time).")
    env: str = Field("calc", description="Environment of the demo.")
    level: int = Field(1, ge=1, description="Environment difficulty level.")
    expert_episodes: int = Field(200, ge=1, description="Expert trajectories for SFT.")
    sft_steps: int = Field(12, ge=1, description="SFT optimizer steps (short on purpose: imitation gets the format, "
                                                 "reinforcement the exact numbers).")
    sft_learning_rate: float = Field(3e-3, gt=0, description="SFT peak learning rate (cosine, 5% warm-up).")
    sft_batch_size: int = Field(16, ge=1, description="SFT examples per step.")
    grpo_steps: int = Field(60, ge=1, description="GRPO steps.")
    grpo_learning_rate: float = Field(3e-4, gt=0, description="GRPO learning rate (constant).")
    prompts_per_step: int = Field(8, ge=1, description="GRPO initial states per step.")
    num_generations: int = Field(8, ge=2, description="GRPO group size.")
    temperature: float = Field(1.0, gt=0, description="GRPO sampling temperature.")
    loss_type: str = Field("dapo", description="GRPO loss aggregation.")
    rollout_model: str | None = Field(None, description="GRPO rollouts from another engine (vllm:PATH on a GPU).")
    eval_episodes: int = Field(200, ge=1, description="Held-out evaluation episodes per stage.")
    eval_seed_start: int = Field(10_000_000, description="First held-out evaluation seed.")
    grpo_seed_start: int = Field(1_000_000, description="First GRPO training seed.")
    seed: int = Field(0, description="Seed of training (data order, sampling).")
    torch_threads: int = Field(1, ge=1, description="CPU threads for torch (1 is fastest on small shared CPUs).")

    @classmethod
    def quick(cls, **overrides: Any) -> "DemoConfig":
        """The scaled-down run CI executes: same stages, minutes less."""
        values: dict[str, Any] = dict(tiny_steps=300, expert_episodes=120, sft_steps=8, grpo_steps=3,
                                      prompts_per_step=4, num_generations=4, eval_episodes=24)
        values.update(overrides)
        return cls(**values)


class StageResult(BaseModel):
    name: str
    model_dir: str
    summary: dict[str, Any]


class DemoResult(BaseModel):
    stages: list[StageResult]
    grpo_history: list[dict[str, float]]
    store: str
    plot: str | None
    seconds: dict[str, float]


def _base_model(cfg: DemoConfig, out: Path, log: Callable[[str], None]) -> Path:
    if cfg.model:
        return Path(cfg.model[3:] if cfg.model.startswith("hf:") else cfg.model)
    from closedloop.models.tiny import TINY_CONFIG_FILE, build_tiny_model

    path = out / "base"
    marker = path / TINY_CONFIG_FILE
    if marker.exists() and json.loads(marker.read_text()).get("train_steps") == cfg.tiny_steps:
        log(f"base model: reusing {path}")
        return path
    log(f"base model: building the tiny model ({cfg.tiny_steps} warm-up steps)")
    build_tiny_model(path, seed=cfg.seed, train_steps=cfg.tiny_steps)
    return path


def _evaluate(name: str, model_dir: Path, cfg: DemoConfig, store: Any) -> tuple[dict[str, Any], list[Any]]:
    from closedloop.evals.envs import make_env
    from closedloop.models.hf import HFClient
    from closedloop.trainers.evaluate import evaluate

    client = HFClient.from_pretrained(model_dir, max_batch_size=64)
    seeds = range(cfg.eval_seed_start, cfg.eval_seed_start + cfg.eval_episodes)
    summary, episodes = evaluate(client, lambda: make_env(cfg.env, level=cfg.level), seeds, name=name,
                                 metadata={"stage": name})
    parent = store.start_run(kind="eval", graph="react", model_spec=f"hf:{model_dir}",
                             config={"env": cfg.env, "level": cfg.level, "seeds": [seeds.start, seeds.stop]},
                             tags=["demo", f"stage:{name}"])
    store.record_trajectories([e.trajectory for e in episodes], kind="eval-episode", graph="react",
                              model_spec=f"hf:{model_dir}", parent_id=parent, tags=["demo", f"stage:{name}"])
    out = summary.as_dict()
    store.finish_run(parent, "completed", outcome={"rewards": {"success": out["success"]}, "summary": out})
    return out, episodes


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


def run_demo(cfg: DemoConfig, log: Callable[[str], None] = print) -> DemoResult:
    import torch

    from closedloop.evals.envs.experts import expert_trajectories
    from closedloop.store import RunStore
    from closedloop.trainers.config import SFTConfig
    from closedloop.trainers.grpo import GRPOConfig, train_grpo
    from closedloop.trainers.sft import train_sft

    torch.set_num_threads(cfg.torch_threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    store_path = cfg.store or str(out / "runs.duckdb")
    store = RunStore(store_path)
    times: dict[str, float] = {}

    t = time.perf_counter()
    base = _base_model(cfg, out, log)
    times["base"] = time.perf_counter() - t

    t = time.perf_counter()
    experts = expert_trajectories(cfg.env, range(cfg.expert_episodes), level=cfg.level)
    store.record_trajectories(experts, kind="expert", graph="expert", model_spec="expert", tags=["demo", "expert"])
    log(f"experts: {len(experts)} {cfg.env} trajectories (level {cfg.level}) recorded")
    sft_cfg = SFTConfig(model=str(base), output_dir=str(out / "sft"), max_steps=cfg.sft_steps,
                        learning_rate=cfg.sft_learning_rate, lr_scheduler="cosine",
                        warmup_steps=max(1, cfg.sft_steps // 20), per_device_batch_size=cfg.sft_batch_size,
                        seed=cfg.seed, save_steps=None, save_total_limit=1, store=store_path, tags=["demo"],
                        torch_threads=cfg.torch_threads, logging_steps=max(1, cfg.sft_steps // 10), run_name="demo-sft")
    sft = train_sft(sft_cfg, experts)
    times["sft"] = time.perf_counter() - t

    t = time.perf_counter()
    grpo_cfg = GRPOConfig(model=str(sft.output_dir), output_dir=str(out / "grpo"), env=cfg.env,
                          env_options={"level": cfg.level}, max_steps=cfg.grpo_steps,
                          learning_rate=cfg.grpo_learning_rate, lr_scheduler="constant",
                          prompts_per_step=cfg.prompts_per_step, num_generations=cfg.num_generations,
                          temperature=cfg.temperature, loss_type=cfg.loss_type,  # type: ignore[arg-type]
                          train_seed_start=cfg.grpo_seed_start, rollout_model=cfg.rollout_model,
                          per_device_batch_size=16, seed=cfg.seed, store=store_path, tags=["demo"],
                          save_steps=None, save_total_limit=1, torch_threads=cfg.torch_threads,
                          logging_steps=max(1, cfg.grpo_steps // 10), run_name="demo-grpo")
    grpo = train_grpo(grpo_cfg)
    times["grpo"] = time.perf_counter() - t

    t = time.perf_counter()
    stages = []
    for name, path in (("base", base), ("sft", sft.output_dir), ("grpo", grpo.output_dir)):
        summary, _ = _evaluate(name, Path(path), cfg, store)
        stages.append(StageResult(name=name, model_dir=str(path), summary=summary))
        log(f"evaluated {name}: success {summary['success']:.3f} "
            f"[{summary['ci_low']:.3f}, {summary['ci_high']:.3f}]")
    times["eval"] = time.perf_counter() - t
    result = DemoResult(stages=stages, grpo_history=grpo.history, store=store_path, plot=None, seconds=times)
    result.plot = str(plot(result, out / "demo.png"))
    (out / "results.json").write_text(result.model_dump_json(indent=2))
    store.close()
    return result


__all__ = ["DemoConfig", "DemoResult", "StageResult", "plot", "run_demo"]
