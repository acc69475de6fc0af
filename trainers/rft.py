"""The RFT generalisation protocol of paper 5 (Xi et al.): train with GRPO on one environment, on
several in sequence, or on a mixture, and measure what carries over and what is forgotten.

Modes (``mode``):

- ``single``: one stage of GRPO on ``envs[0]``;
- ``sequential``: one stage per environment in order, each starting from the previous stage's model;
- ``mixture``: one stage on a :class:`MixtureEnv`, which picks a sub-environment per episode with
  probabilities proportional to ``envs[i].weight`` from an RNG seeded by the episode seed (so the
  G episodes of a GRPO group, which share a seed, share the environment too).

After the base model and after every stage, the model is evaluated greedily on held-out seeds of
every evaluation environment (``eval_envs``, default: the training environments). The result is an
:class:`EvalMatrix` (rows: ``base`` and the stages; columns: environments) with

- gain[i][j] = score[i][j] − score[base][j];
- transfer_j = score[final][j] − score[base][j] for an environment j never trained on (held out);
- forgetting_j = score[i_j][j] − score[final][j] for an environment j last trained at stage i_j
  (positive: the later stages lost some of what stage i_j gained).

The matrix is logged to the run store (one ``kind="train"`` run, ``trainer: rft``: metrics
``score/<env>``, ``gain/<env>`` at step = row index; ``transfer/<env>``, ``forgetting/<env>`` at the
last row; the whole matrix in the run's outcome), printed as a rich table, and drawn as a heatmap
(``matrix.png``, matplotlib) with ``matrix.json`` in ``output_dir``.

The score of an environment is its mean ``success`` component when it has one (calc, clarify),
else its mean episode reward (simul: BLEU-by-deadline minus lag), or as set by ``score``.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from closedloop.trainers.grpo import GRPOConfig, GRPOResult, train_grpo
from closedloop.trainers.recipes.runner import StageContext, StageInterrupted, StageKind

__all__ = ["EnvSpec", "RFTConfig", "RFTResult", "EvalMatrix", "MixtureEnv", "mixture_choice", "run_rft",
           "run_from_config", "CONFIG_CLASS", "render_table", "plot_matrix", "RFTStage", "RFT_STAGE"]


class EnvSpec(BaseModel):
    """An environment of the protocol: a registered name, its options, a label and a mixture weight."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., description="closedloop.environments name (calc, clarify, simul, ...).")
    options: dict[str, Any] = Field(default_factory=dict, description="The environment's keyword options.")
    label: str | None = Field(None, description="Column name in the matrix (default: name, or name-L<level>).")
    weight: float = Field(1.0, gt=0, description="Mixture sampling weight (normalised over the mixture).")
    max_env_steps: int | None = Field(None, ge=1, description="Turns per evaluation episode (null: the config's).")

    @property
    def key(self) -> str:
        if self.label:
            return self.label
        level = self.options.get("level")
        return f"{self.name}-L{level}" if level is not None else self.name

    def factory(self) -> Callable[[], Any]:
        from closedloop.evals.envs import make_env

        make_env(self.name, **self.options)  # fail early on a bad name or option
        return lambda: make_env(self.name, **self.options)


class RFTConfig(GRPOConfig):
    """GRPO in stages over environments (paper 5), with the evaluation matrix. Every GRPO key applies
    to each stage; ``env``/``env_options`` are used only when ``envs`` is empty (``single`` on them)."""

    mode: Literal["single", "sequential", "mixture"] = Field("single", description="single: one environment; "
                                                             "sequential: envs in order; mixture: envs by weight.")
    envs: list[EnvSpec] = Field(default_factory=list,
                                description="Training environments: [{name, options, label, weight}]; empty: "
                                            "[{name: env, options: env_options}].")
    eval_envs: list[EnvSpec] = Field(default_factory=list, description="Evaluation columns (default: the training "
                                                                       "environments); add held-out ones here.")
    steps_per_stage: int | None = Field(None, ge=1, description="GRPO steps of each stage (null: max_steps).")
    eval_episodes: int = Field(32, ge=1, description="Held-out greedy episodes per (stage, environment).")
    eval_seed_start: int = Field(10_000_000, description="First evaluation seed (keep outside the training seeds).")
    score: Literal["auto", "success", "reward"] = Field("auto", description="Matrix score: success rate, mean "
                                                        "reward, or auto (success when the env reports it).")
    plot: bool = Field(True, description="Write matrix.png (matplotlib).")
    evaluate_base: bool = Field(True, description="Evaluate the starting model (needed for gain and transfer).")

    @model_validator(mode="after")
    def _envs(self) -> "RFTConfig":
        if not self.envs:
            self.envs = [EnvSpec(name=self.env, options=dict(self.env_options))]
        if self.mode == "single" and len(self.envs) != 1:
            raise ValueError(f"mode single trains on one environment; got {len(self.envs)} (use sequential or mixture)")
        from closedloop.evals.envs import make_env

        for spec in self.envs + self.eval_envs:  # a bad name or option fails here, not after a stage
            try:
                make_env(spec.name, **spec.options)
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"environment {spec.name!r}: {e}") from None
        keys = [e.key for e in self.envs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"environment labels must be distinct, got {keys}; set label")
        return self

    @property
    def columns(self) -> list[EnvSpec]:
        cols = list(self.eval_envs or self.envs)
        have = {c.key for c in cols}
        return cols + [e for e in self.envs if e.key not in have]  # every trained env is a column


# --------------------------------------------------------------------------- mixture


def mixture_choice(seed: int, weights: Sequence[float]) -> int:
    """The sub-environment of episode ``seed``: a draw from ``weights`` (normalised) with an RNG seeded
    by the episode seed alone, so every episode of a GRPO group (same seed) gets the same one."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"mixture weights must be positive, got {list(weights)}")
    return random.Random(f"mixture:{int(seed)}").choices(range(len(weights)), weights=list(weights))[0]


class MixtureEnv:
    """An :class:`~closedloop.env.AgentEnvironment` that delegates each episode to one of several
    environments, chosen per seed by :func:`mixture_choice`; ``info["mixture_env"]`` names it."""

    def __init__(self, factories: Sequence[Callable[[], Any]], weights: Sequence[float],
                 labels: Sequence[str] | None = None) -> None:
        if len(factories) != len(weights) or not factories:
            raise ValueError("one weight per environment, at least one environment")
        self.factories, self.weights = list(factories), [float(w) for w in weights]
        mixture_choice(0, self.weights)  # validates the weights
        self.labels = list(labels or [str(i) for i in range(len(factories))])
        self.current: Any = None
        self.index: int | None = None

    async def areset(self, seed: int | None = None) -> tuple[list[Any], dict[str, Any]]:
        from closedloop.evals.envs.base import fresh_seed

        seed = fresh_seed() if seed is None else int(seed)
        self.index = mixture_choice(seed, self.weights)
        self.current = self.factories[self.index]()
        obs, info = await self.current.areset(seed)
        return obs, {**info, "mixture_env": self.labels[self.index], "seed": seed}

    async def astep(self, action: Any) -> tuple[list[Any], float, bool, bool, dict[str, Any]]:
        if self.current is None:
            raise RuntimeError("mixture: call areset() first")
        obs, reward, terminated, truncated, info = await self.current.astep(action)
        return obs, reward, terminated, truncated, {**info, "mixture_env": self.labels[self.index or 0]}


# --------------------------------------------------------------------------- the matrix


@dataclass
class EvalMatrix:
    """scores[i][j]: row i (``rows[0]`` = base when evaluated), column j. ``trained_at[col]``: the last
    row whose stage trained on that column's environment (absent: held out)."""

    rows: list[str]
    cols: list[str]
    scores: list[list[float]]
    trained_at: dict[str, int] = field(default_factory=dict)
    base_row: int | None = 0

    def __post_init__(self) -> None:
        if len(self.scores) != len(self.rows) or any(len(r) != len(self.cols) for r in self.scores):
            raise ValueError(f"scores must be {len(self.rows)} x {len(self.cols)}")
        bad = {c: i for c, i in self.trained_at.items() if c not in self.cols or not 0 <= i < len(self.rows)}
        if bad:
            raise ValueError(f"trained_at names unknown columns or rows: {bad}")

    def score(self, row: int, col: str) -> float:
        return self.scores[row][self.cols.index(col)]

    def gain(self) -> list[list[float]]:
        """score − base score, every cell (the base row is all zeros)."""
        if self.base_row is None:
            raise ValueError("no base row: gain and transfer need the base model's scores")
        base = self.scores[self.base_row]
        return [[s - b for s, b in zip(row, base)] for row in self.scores]

    def transfer(self) -> dict[str, float]:
        """Held-out columns: score after the final stage − base score."""
        g = self.gain()
        return {c: g[-1][j] for j, c in enumerate(self.cols) if c not in self.trained_at}

    def forgetting(self) -> dict[str, float]:
        """Trained columns: score after the stage that (last) trained on it − score after the final stage."""
        return {c: self.score(i, c) - self.scores[-1][self.cols.index(c)] for c, i in self.trained_at.items()}

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": self.rows, "cols": self.cols, "scores": self.scores,
                               "trained_at": self.trained_at, "forgetting": self.forgetting()}
        if self.base_row is not None:
            out.update(gain=self.gain(), transfer=self.transfer())
        return out


def render_table(matrix: EvalMatrix, title: str = "RFT evaluation matrix") -> Any:
    """A rich table: one row per stage, score (and gain over base) per environment; held-out
    columns marked *, the last rows give forgetting and transfer."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("stage")
    for c in matrix.cols:
        table.add_column(c + ("" if c in matrix.trained_at else " *"), justify="right")
    gain = matrix.gain() if matrix.base_row is not None else None
    for i, r in enumerate(matrix.rows):
        cells = []
        for j, s in enumerate(matrix.scores[i]):
            cells.append(f"{s:.3f}" + (f" ({gain[i][j]:+.3f})" if gain is not None and i != matrix.base_row else ""))
        table.add_row(r, *cells)
    fg, tr = matrix.forgetting(), (matrix.transfer() if gain is not None else {})
    table.add_row("forgetting", *[f"{fg[c]:+.3f}" if c in fg else "" for c in matrix.cols], style="dim")
    if gain is not None:
        table.add_row("transfer", *[f"{tr[c]:+.3f}" if c in tr else "" for c in matrix.cols], style="dim")
    return table


def plot_matrix(matrix: EvalMatrix, path: str | Path) -> Path:
    """Heatmap of the scores (annotated with score and gain); held-out columns marked *."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = len(matrix.rows), len(matrix.cols)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * cols, 1.0 + 0.6 * rows))
    im = ax.imshow(matrix.scores, cmap="viridis", aspect="auto")
    gain = matrix.gain() if matrix.base_row is not None else None
    for i in range(rows):
        for j in range(cols):
            text = f"{matrix.scores[i][j]:.2f}" + (f"\n{gain[i][j]:+.2f}" if gain is not None and i else "")
            ax.text(j, i, text, ha="center", va="center", color="w", fontsize=8)
    ax.set_xticks(range(cols), [c + ("" if c in matrix.trained_at else " *") for c in matrix.cols])
    ax.set_yticks(range(rows), matrix.rows)
    ax.set_xlabel("evaluation environment (* held out)")
    ax.set_ylabel("after stage")
    fig.colorbar(im, ax=ax, label="score")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- protocol


@dataclass
class RFTResult:
    output_dir: Path
    run_id: str | None
    matrix: EvalMatrix
    stages: list[GRPOResult]
    plot: Path | None = None
    status: str = "completed"

    @property
    def interrupted(self) -> bool:
        """A stage was interrupted (Ctrl-C): later stages did not run; ``closedloop train`` exits 130."""
        return self.status == "interrupted"

    @property
    def step(self) -> int:
        return sum(s.steps for s in self.stages)


def _score(episodes: list[Any], how: str) -> float:
    if not episodes:
        return 0.0
    has_success = all("success" in e.trajectory.rewards for e in episodes)
    if how == "success" or (how == "auto" and has_success):
        return sum(e.trajectory.rewards.get("success", 0.0) > 0 for e in episodes) / len(episodes)
    return sum(e.reward for e in episodes) / len(episodes)


def evaluate_row(model_dir: str | Path, config: RFTConfig) -> list[float]:
    """Greedy held-out scores of one model on every column."""
    from closedloop.models.base import SamplingParams
    from closedloop.models.hf import HFClient
    from closedloop.trainers.evaluate import aevaluate

    client = HFClient.from_pretrained(str(model_dir), max_batch_size=config.max_batch_size)
    seeds = range(config.eval_seed_start, config.eval_seed_start + config.eval_episodes)
    params = SamplingParams(temperature=0.0, max_tokens=config.max_new_tokens)
    row = []
    for spec in config.columns:
        _, episodes = asyncio.run(aevaluate(client, spec.factory(), seeds, name=spec.key, graph=config.graph,
                                            params=params, max_steps=spec.max_env_steps or config.max_env_steps))
        row.append(_score(episodes, config.score))
    return row


def _stage_plan(config: RFTConfig) -> list[tuple[str, list[EnvSpec]]]:
    if config.mode == "mixture":
        return [("mixture", list(config.envs))]
    return [(e.key, [e]) for e in config.envs]


def _stage_factory(envs: list[EnvSpec]) -> Callable[[], Any]:
    if len(envs) == 1:
        return envs[0].factory()
    factories = [e.factory() for e in envs]
    weights, labels = [e.weight for e in envs], [e.key for e in envs]
    return lambda: MixtureEnv(factories, weights, labels)


def run_rft(config: RFTConfig, *, log: Callable[[str], None] | None = None) -> RFTResult:
    """Base evaluation, then each stage (GRPO from the previous model) and its evaluation row."""
    from rich.console import Console

    console = Console()
    say = log or console.print
    config.check_paths()
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = run_id = None
    if "store" in config.report_to:
        from closedloop.store import RunStore

        store = RunStore(config.store) if config.store else RunStore()
        run_id = store.start_run(kind="train", model_spec=config.model, config=config.model_dump(mode="json"),
                                 tags=list(config.tags) + ["rft", f"rft:{config.mode}"],
                                 metadata={"trainer": "rft", "mode": config.mode, "output_dir": str(out)})
    cols = [c.key for c in config.columns]
    rows: list[str] = []
    scores: list[list[float]] = []
    trained_at: dict[str, int] = {}
    stages: list[GRPOResult] = []

    def add_row(name: str, model_dir: str | Path) -> None:
        row = evaluate_row(model_dir, config)
        rows.append(name)
        scores.append(row)
        say(f"rft: {name}: " + ", ".join(f"{c}={s:.3f}" for c, s in zip(cols, row)))
        if store is not None and run_id is not None:
            store.log_metrics(run_id, len(rows) - 1, {f"score/{c}": s for c, s in zip(cols, row)})

    status = "failed"
    error: Exception | None = None
    try:
        model: str | Path = config.model_path
        if config.evaluate_base:
            add_row("base", model)
        for k, (name, envs) in enumerate(_stage_plan(config)):
            stage_dir = out / f"stage-{k + 1}-{name}"
            fields = config.model_dump(exclude=set(RFTConfig.model_fields) - set(GRPOConfig.model_fields))
            fields.update(model=str(model), output_dir=str(stage_dir), env=envs[0].name,
                          env_options=dict(envs[0].options), max_steps=config.steps_per_stage or config.max_steps,
                          max_env_steps=max(e.max_env_steps or config.max_env_steps for e in envs),
                          run_name=f"{config.run_name or out.name}-{name}",
                          tags=list(config.tags) + ["rft"] + ([f"rft:{run_id}"] if run_id else []),
                          seed=config.seed + k)
            say(f"rft: stage {k + 1}: GRPO on {name} for {fields['max_steps']} steps")
            result = train_grpo(GRPOConfig(**fields), make_env=_stage_factory(envs))
            stages.append(result)
            if result.interrupted:  # Ctrl-C inside the stage: its checkpoint is saved
                status = "interrupted"
                break
            model = result.output_dir
            add_row(f"{k + 1}:{name}", model)
            for e in envs:
                trained_at[e.key] = len(rows) - 1
        else:
            status = "completed"
    except Exception as e:
        error = e
        raise
    finally:
        matrix = EvalMatrix(rows, cols, scores, {c: i for c, i in trained_at.items() if c in cols},
                            0 if config.evaluate_base else None)
        plot = None
        if rows:
            (out / "matrix.json").write_text(json.dumps(matrix.as_dict(), indent=2))
            console.print(render_table(matrix, f"RFT evaluation matrix ({config.mode})"))
            if config.plot:
                plot = plot_matrix(matrix, out / "matrix.png")
        if store is not None and run_id is not None:
            if rows and status == "completed":
                last = len(rows) - 1
                final = {f"forgetting/{c}": v for c, v in matrix.forgetting().items()}
                if matrix.base_row is not None:
                    final.update({f"gain/{c}": v for c, v in zip(cols, matrix.gain()[last])})
                    final.update({f"transfer/{c}": v for c, v in matrix.transfer().items()})
                if final:
                    store.log_metrics(run_id, last, final)
            store.finish_run(run_id, status, outcome={"matrix": matrix.as_dict()} if rows else None, error=error)
    return RFTResult(out, run_id, matrix, stages, plot, status)


CONFIG_CLASS = RFTConfig


def run_from_config(config: RFTConfig) -> RFTResult:
    return run_rft(config)


# --------------------------------------------------------------------------- as a recipe stage


class RFTStage(BaseModel):
    """The protocol as one stage of a recipe (kind ``rft``)."""

    model_config = ConfigDict(extra="forbid")

    rft: RFTConfig = Field(..., description="The protocol's config (closedloop train rft --list-keys).")


def _rft_stage(config: RFTStage, ctx: StageContext) -> dict[str, Any]:
    result = run_rft(config.rft, log=ctx.log)
    if result.interrupted:
        raise StageInterrupted(f"RFT stopped in stage {len(result.stages)}")
    return {"output_dir": str(result.output_dir), "run_id": result.run_id, "matrix": result.matrix.as_dict(),
            "plot": str(result.plot) if result.plot else None,
            "model_dir": str(result.stages[-1].output_dir) if result.stages else config.rft.model_path}


RFT_STAGE = StageKind(RFTStage, _rft_stage, "the RFT generalisation protocol: GRPO stages and the evaluation matrix")
