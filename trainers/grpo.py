"""Multi-turn GRPO on agent graphs: rollouts run the graph, the loss is on the sampled tokens.

One step:

1. ``prompts_per_step`` environment seeds, ``num_generations`` episodes each from the identical
   initial state, run by the registered graph on the live policy (:mod:`.rollout`);
2. rewards: the environment's named components (weighted) and named reward functions, per
   episode and, for ``turn_reward_components``, per turn; advantages by the documented turn-level
   rule of :mod:`.advantages` (plain GRPO when there are no per-turn rewards);
3. ``num_iterations`` optimisation passes over the batch with the sampling logprobs as old
   logprobs (tempered, as ``hf:`` records them and as :func:`.losses.token_logprobs` recomputes);
   when rollouts come from another engine (``rollout_model``: ``vllm:`` or an OpenAI-compatible
   server returning token ids) the old logprobs are the trainer's own and a truncated
   importance weight ``π_trainer/π_sampler`` corrects for the engine mismatch (TRL's
   ``vllm_importance_sampling_correction``);
4. the loss of :func:`.losses.grpo_loss` (grpo, dr_grpo, dapo, bnpo; ε_low/ε_high; k3 KL to a
   reference with β, none loaded when β = 0).

Our loop, not TRL's ``GRPOTrainer``: TRL's rollout is a single completion (or a user
``rollout_func`` that re-implements the agent), its advantages are per sequence, and it
re-tokenises; here the graph that is served and evaluated is the graph that is trained, and
credit can land on turns.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator

from closedloop.evals.harness.executor import ExecutorConfig
from closedloop.models.base import Pausable, SamplingParams
from closedloop.trainers.config import TrainConfig, checking_paths
from closedloop.trainers.constrained import ConstraintSet, CostConstraint
from closedloop.trainers.grpo_batch import RewardSpec, RolloutBatch, build_batch, load_reward_fn
from closedloop.trainers.losses import LOSS_TYPES, entropy_from_logits, gather_logps, grpo_loss, \
    importance_sampling_weights
from closedloop.trainers.rollout import EnvFactory, GraphPolicy, Group, collect_groups
from closedloop.trainers.rollout_thread import RolloutThread
from closedloop.trainers.session import TrainingSession


class GRPOConfig(TrainConfig):
    """Multi-turn GRPO on a built-in or plugin environment, with a registered graph as the policy."""

    env: str = Field("calc", description="Environment name: an entry point of group closedloop.environments "
                                         "(closedloop plugins environments: calc, clarify, simul, factguard, ...).")
    env_options: dict[str, Any] = Field(default_factory=dict, description="Keyword options of the environment "
                                                                          "(e.g. level, weights).")
    graph: str = Field("react", description="The agent graph that acts (closedloop.graphs entry point).")
    graph_options: dict[str, Any] = Field(default_factory=dict, description="Extra keyword options of the graph.")
    prompts_per_step: int = Field(8, ge=1, description="Environment seeds (initial states) per step, per process.")
    num_generations: int = Field(8, ge=2, description="Episodes per initial state: the GRPO group size G "
                                                      "(TRL default 8).")
    train_seed_start: int = Field(0, description="Training seeds are drawn from [train_seed_start, "
                                                 "train_seed_start + train_seed_count); keep evaluation seeds outside.")
    train_seed_count: int = Field(1_000_000, ge=1, description="Size of the training seed range.")
    max_env_steps: int = Field(8, ge=1, description="Agent turns per episode before it is truncated.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of rollouts; the loss recomputes "
                                                      "logprobs at the same temperature (TRL default 1.0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of rollouts (does not change recorded "
                                                      "logprobs, see LogprobSpec).")
    max_new_tokens: int = Field(64, ge=1, description="Tokens per agent turn.")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "dapo", description="Aggregation of the per-token loss (TRL's loss_type; TRL's default is dapo).")
    epsilon_low: float = Field(0.2, ge=0, description="Lower clip: ratio >= 1 - epsilon_low (TRL epsilon).")
    epsilon_high: float = Field(0.2, ge=0, description="Upper clip: ratio <= 1 + epsilon_high (DAPO clip-higher "
                                                       "uses 0.28).")
    delta: float | None = Field(None, description="Two-sided clipping upper bound of the unclipped ratio "
                                                  "(TRL's delta); null disables.")
    beta: float = Field(0.0, ge=0, description="k3 KL coefficient; 0 loads no reference model (TRL default 0).")
    num_iterations: int = Field(1, ge=1, description="Optimisation passes (optimizer steps) per rollout batch: "
                                                     "TRL's num_iterations (mu).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage std scaling (TRL's scale_rewards; 'none' is Dr. GRPO's choice).")
    reward_weights: dict[str, float] = Field(default_factory=dict, description="Weight per reward component or "
                                                                               "function name; unnamed weigh 1.0.")
    reward_funcs: list[str] = Field(default_factory=list, description="Extra rewards: 'package.module:function' "
                                                                      "callables of a finished Trajectory, each "
                                                                      "logged apart under its function name.")
    turn_reward_components: list[str] = Field(default_factory=list, description="Components credited per turn "
                                                                                "(e.g. [info_gain]); others form "
                                                                                "the final reward.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of per-turn rewards in the return-to-go.")
    turn_weight: float = Field(1.0, ge=0, description="Weight of the turn-level advantage added to the final one.")
    turn_baseline: Literal["group", "position"] = Field(
        "group", description="Baseline of the turn-level returns: all turns of the group, or the group's turns "
                             "at the same index (see closedloop.trainers.advantages).")
    missing_turn_rewards: Literal["zero", "exclude"] = Field(
        "zero", description="A turn without a per-turn reward (none of turn_reward_components applied, e.g. "
                            "clarify's info_gain on a submit): 'zero' counts it as 0; 'exclude' gives it no "
                            "turn advantage and keeps it out of the baselines (closedloop.trainers.advantages).")
    rollout_model: str | None = Field(None, description="Rollouts from another engine (vllm:PATH or "
                                                        "openai:NAME@URL with token ids) instead of the live policy; "
                                                        "weights are pushed to it after each update where it supports "
                                                        "it (see docs), and importance sampling corrects the mismatch.")
    importance_sampling: Literal["auto", "on", "off"] = Field(
        "auto", description="Truncated IS correction pi_trainer/pi_sampler: auto = on with rollout_model.")
    importance_sampling_cap: float = Field(3.0, gt=0, description="Truncation of the IS weight (TRL default 3.0).")
    rollout_concurrency: int | None = Field(None, ge=1, description="Episodes run at once (null: all).")
    executor: ExecutorConfig = Field(
        default_factory=ExecutorConfig,
        description="Where rollouts run: local (the live policy in this process, the default) or ray (executor.workers "
                    "rollout actors, each a copy of the policy with executor.resources, weights pushed after each "
                    "update; see closedloop.trainers.ray_rollout). A plain 'ray' reads as {kind: ray}.")
    max_batch_size: int = Field(64, ge=1, description="Largest decode batch of the live policy's client.")
    prefetch_rollouts: bool = Field(
        True, description="Start the next batch's episodes (environment reset, graph up to its first model call) "
                          "while the optimizer step runs; their generation waits for the updated weights, so "
                          "results are identical. Applies to the live policy (no rollout_model).")
    learning_rate: float = Field(1e-6, gt=0, description="Peak AdamW learning rate (TRL GRPOConfig default 1e-6).")
    max_steps: int | None = Field(100, ge=1, description="GRPO steps (rollout batches).")
    save_steps: int | None = Field(None, ge=1, description="Checkpoint every this many steps (null: at the end).")
    logging_steps: int = Field(1, ge=1, description="Report metrics every this many steps.")
    max_length: int | None = Field(None, ge=2, description="Truncate each training sequence (null: keep all).")
    constraints: list[CostConstraint] = Field(
        default_factory=list, description="Cost budgets E[cost] <= budget (turns, tool_calls, completion_tokens, "
                                          "latency_s, component:NAME, info:KEY, module:function), each enforced by a "
                                          "Lagrange multiplier updated by dual ascent (trainers/constrained.py).")

    @model_validator(mode="after")
    def _one_rollout_engine(self) -> "GRPOConfig":
        if self.executor.kind == "ray" and self.rollout_model:
            raise ValueError("executor ray runs rollouts on actors holding copies of the policy; rollout_model names "
                             "another engine: set one of them")
        return self

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_new_tokens)

    @field_validator("env", "graph")
    @classmethod
    def _registered(cls, value: str, info: ValidationInfo) -> str:
        """A name that no plugin gives fails with the config's other errors, before any model loads
        (checked with the paths: a name registered in-process later is fine for a config built early)."""
        if checking_paths(info):
            from closedloop import plugins

            kind = "environments" if info.field_name == "env" else "graphs"
            known = plugins.registry(kind).names()
            if value not in known:
                raise ValueError(f"{info.field_name} {value!r} is not a registered {plugins.KINDS[kind].noun}; "
                                 f"available: {', '.join(known)}")
        return value


@dataclass
class GRPOResult:
    output_dir: Path
    run_id: str | None
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)
    interrupted: bool = False  #: a Ctrl-C stopped it after saving a checkpoint (``resume: auto`` continues)

    @property
    def step(self) -> int:
        """The last step done (what SFT's and DPO's results call ``step``)."""
        return self.steps

    @property
    def metrics(self) -> dict[str, float]:
        """The last logged step's metrics."""
        return self.history[-1] if self.history else {}


def reward_spec(config: GRPOConfig) -> RewardSpec:
    return RewardSpec(weights=dict(config.reward_weights), turn_components=list(config.turn_reward_components),
                      functions=dict(load_reward_fn(p) for p in config.reward_funcs))


def predicting_positions(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: the positions whose logits predict a trained token (position t-1 predicts
    token t; column 0 is predicted by nothing)."""
    pred = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    pred[:, :-1] = mask[:, 1:] != 0
    return pred


def policy_logits(model: Any, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Float logits ``[N, V]`` of only the N positions that predict a token ``mask`` trains, in
    row-major order (:func:`predicting_positions`). The LM head, the log-softmax and their backward
    then skip everything else: the shared prompt (as TRL's ``logits_to_keep``), but also padding and
    the tool, user and template tokens between turns. The hidden states, hence the numbers, are
    those of the full computation (``tests/trainers/test_grpo_logits_to_keep.py``)."""
    pred = predicting_positions(mask)
    if _keeps_masked_logits(model):  # transformers' slice_logits_to_keep: a bool [B, T] keeps those positions, flat
        return model(input_ids=ids, attention_mask=attn, logits_to_keep=pred).logits.float()
    return model(input_ids=ids, attention_mask=attn).logits.float()[pred]


def _keeps_masked_logits(model: Any) -> bool:
    target = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft passes kwargs on
    cls: Any = type(target)
    return _forward_keeps_masked_logits(cls)


@functools.lru_cache(maxsize=None)
def _forward_keeps_masked_logits(cls: Any) -> bool:
    """Whether ``cls.forward`` slices with transformers' ``slice_logits_to_keep`` (which takes a bool
    ``[B, T]`` mask); a model that slices by hand (``hidden[:, -k:]``) gets full logits. Once per class."""
    import inspect

    try:
        return ("logits_to_keep" in inspect.signature(cls.forward).parameters
                and "slice_logits_to_keep(" in inspect.getsource(cls.forward))
    except (TypeError, ValueError, OSError):
        return False


def policy_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B, T]`` token logprobs (tempered) from :func:`policy_logits`: the trained tokens' in place, 0 elsewhere."""
    sel = mask != 0  # the trained tokens, which those positions predict (column 0 has no prediction)
    sel[:, 0] = False
    scaled = logits if temperature == 1.0 else logits / temperature
    logps = gather_logps(scaled, ids[sel])
    return logps.new_zeros(ids.shape).masked_scatter(sel, logps)


def sequence_logprobs(model: Any, batch: RolloutBatch, temperature: float, micro: int) -> torch.Tensor:
    """Token logprobs of a whole batch without gradient (old or reference logprobs), on the tokens the
    loss trains (0 elsewhere: nothing reads them)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(batch), micro):
            ids, attn, mask = batch.input_ids[i:i + micro], batch.attention_mask[i:i + micro], batch.loss_mask[i:i + micro]
            out.append(policy_logprobs(policy_logits(model, ids, attn, mask), ids, mask, temperature))
    return torch.cat(out)


class GRPOObjective:
    """The loss of one optimisation pass over a rollout batch, one micro-batch (a slice of
    ``per_device_batch_size`` rows) at a time: :meth:`TrainingSession.train_step` runs
    :meth:`micro_batches` through it into one optimizer step. :attr:`metrics` sums the pass's.

    Micro-batch losses are weighted by their row fraction for grpo/bnpo/dr_grpo (TRL's
    gradient-accumulation semantics: for grpo and dr_grpo this is exactly the whole-batch loss; bnpo
    normalises per micro-batch, as TRL's does), and dapo gets the whole batch's token count as
    ``num_items_in_batch`` (exactly the whole-batch loss). Dr. GRPO's constant normaliser ("max completion
    length") is, for multi-turn episodes, the most tokens an episode can generate:
    ``max_env_steps * max_new_tokens``. Under DDP each process's loss is its own batch's, and DDP
    averages the gradients over processes.
    """

    def __init__(self, model: Any, batch: RolloutBatch, config: GRPOConfig, *, old_logps: torch.Tensor,
                 ref_logps: torch.Tensor | None, is_weights: torch.Tensor | None) -> None:
        self.model, self.batch, self.config = model, batch, config
        self.old_logps, self.ref_logps, self.is_weights = old_logps, ref_logps, is_weights
        self.total_tokens = int(batch.loss_mask.sum())
        self.metrics: dict[str, float] = {}

    def micro_batches(self) -> list[slice]:
        micro = self.config.per_device_batch_size
        return [slice(i, i + micro) for i in range(0, len(self.batch), micro)]

    def __call__(self, rows: slice) -> torch.Tensor:
        config, batch, sums = self.config, self.batch, self.metrics
        ids, attn, mask = batch.input_ids[rows], batch.attention_mask[rows], batch.loss_mask[rows]
        logits = policy_logits(self.model, ids, attn, mask)  # [N, V]: the positions that predict trained tokens
        logps = policy_logprobs(logits, ids, mask, config.temperature)
        loss, m = grpo_loss(logps, self.old_logps[rows], batch.advantages[rows], mask,
                            ref_logps=None if self.ref_logps is None else self.ref_logps[rows], beta=config.beta,
                            epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high,
                            loss_type=config.loss_type,
                            is_weights=None if self.is_weights is None else self.is_weights[rows],
                            num_items_in_batch=self.total_tokens if config.loss_type == "dapo" else None,
                            max_completion_length=config.max_env_steps * config.max_new_tokens, delta=config.delta)
        scale = 1.0 if config.loss_type == "dapo" else ids.shape[0] / len(batch)
        with torch.no_grad():
            ent = entropy_from_logits(logits / config.temperature).sum() if logits.numel() else 0.0
        w = float(mask.sum()) / max(self.total_tokens, 1.0)
        sums["loss"] = sums.get("loss", 0.0) + float(loss.detach()) * scale
        sums["entropy"] = sums.get("entropy", 0.0) + float(ent) / max(self.total_tokens, 1.0)
        for k, v in m.items():
            if k != "num_tokens":
                sums[k] = sums.get(k, 0.0) + float(v) * w
        return loss * scale


def _episode_stats(groups: list[Group], batch: RolloutBatch) -> dict[str, float]:
    eps = [e for g in groups for e in g.episodes]
    comp = [len(t.completion_ids or []) for e in eps for t in e.trajectory.turns]
    stats = dict(batch.stats)
    stats.update({"turns_mean": sum(e.steps for e in eps) / max(len(eps), 1),
                  "completion_length_mean": sum(comp) / max(len(comp), 1),
                  "truncated_episodes": float(sum(e.truncated for e in eps)),
                  "failed_episodes": float(sum(e.error is not None for e in eps)),
                  "reward_std": _std([e.reward for e in eps]),
                  "frac_zero_std_groups": sum(_std(g.rewards) == 0 for g in groups) / max(len(groups), 1)})
    return stats


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _nothing_to_train(batch: RolloutBatch, accel: Any) -> bool:
    """True when no process has a trained token this step (all must agree under DDP, or the
    processes that skip would leave the others waiting in the gradient all-reduce)."""
    local = torch.tensor([float(batch.loss_mask.sum() > 0) if len(batch) else 0.0], device=accel.device)
    if accel.num_processes == 1:
        return not bool(local.item())
    anyone = float(accel.reduce(local, reduction="sum").item())
    if anyone and not local.item():
        raise RuntimeError("this process has no trainable tokens in its rollout batch while others do; "
                           "raise prompts_per_step or check for failing episodes (metadata['error'])")
    return anyone == 0


def _sum_over_processes(accel: Any) -> Callable[[list[float]], list[float]] | None:
    if accel.num_processes == 1:
        return None
    return lambda xs: accel.reduce(torch.tensor(xs, dtype=torch.float64, device=accel.device),
                                   reduction="sum").tolist()


def make_env_factory(name: str, options: dict[str, Any]) -> EnvFactory:
    from closedloop.evals.envs import make_env

    make_env(name, **options)  # fail early on a bad name or option
    return lambda: make_env(name, **options)


def train_grpo(config: GRPOConfig, *, model: Any = None, tokenizer: Any = None, make_env: EnvFactory | None = None,
               on_step: Callable[[int, dict[str, float]], None] | None = None) -> GRPOResult:
    """Run GRPO as configured; returns where the model went and the metric history."""
    config.check_paths(model_given=model is not None and tokenizer is not None)
    make_env = make_env or make_env_factory(config.env, config.env_options)  # a bad name fails before any loading
    total = config.max_steps or 1
    with TrainingSession(config, kind="grpo", model=model, tokenizer=tokenizer, total_steps=total,
                         optimizer_steps=total * config.num_iterations) as session:
        history = _train(session, config, make_env, on_step)
        if not session.interrupted:
            session.save_final()
    return GRPOResult(Path(config.output_dir), session.run_id, session.state.step, history, session.interrupted)


def _rollout_client(session: TrainingSession, config: GRPOConfig) -> Any:
    """The engine rollouts run on: the live policy (``hf:`` over the model being trained) or ``rollout_model``."""
    if config.rollout_model:
        from closedloop.trainers.weight_sync import make_rollout_client

        return make_rollout_client(config.rollout_model)
    from closedloop.models.hf import HFClient

    # batch_gap_ms: a rollout batch's first requests arrive in one burst; start as soon as it ends
    return HFClient.from_model(session.unwrapped_model, session.tokenizer, name=f"policy:{config.model_path}",
                               max_batch_size=config.max_batch_size, batch_gap_ms=1.0)


def _frozen_copy(model: Any) -> Any:
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _on_device(batch: RolloutBatch, device: Any) -> RolloutBatch:
    return RolloutBatch(batch.input_ids.to(device), batch.attention_mask.to(device), batch.loss_mask.to(device),
                        batch.old_logps.to(device), batch.logprob_mask.to(device), batch.advantages.to(device),
                        batch.rows_per_episode, batch.truncated_tokens, batch.stats)


def _old_logps(policy: Any, batch: RolloutBatch, config: GRPOConfig,
               use_is: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The old logprobs of the ratio and the truncated IS weights (None when not used): the
    sampler's recorded logprobs, or the trainer's own where the sampler gave none (TRL's
    ``old_per_token_logps``), or with importance sampling the trainer's, the sampler's entering the weights."""
    if not use_is and not bool((batch.logprob_mask < batch.loss_mask).any()):
        return batch.old_logps, None
    trainer_old = sequence_logprobs(policy, batch, config.temperature, config.per_device_batch_size)
    if not use_is:
        return torch.where(batch.logprob_mask.bool(), batch.old_logps, trainer_old), None
    return trainer_old, importance_sampling_weights(trainer_old, batch.old_logps, batch.loss_mask,
                                                    clip_max=config.importance_sampling_cap,
                                                    sampler_mask=batch.logprob_mask)


def _train(session: TrainingSession, config: GRPOConfig, make_env: EnvFactory,
           on_step: Callable[[int, dict[str, float]], None] | None) -> list[dict[str, float]]:
    """The loop of :func:`train_grpo` on an open session; returns the metric history."""
    accel, policy, unwrapped = session.accelerator, session.model, session.unwrapped_model
    from closedloop.trainers.weight_sync import make_weight_sync

    client: Any = None
    actors = None
    if config.executor.kind == "ray":  # rollout actors, each a copy of the policy (trainers/ray_rollout.py)
        from closedloop.trainers.ray_rollout import RayRollouts

        actors = RayRollouts.for_config(config, make_env, client_name=f"policy:{config.model_path}")
        sync: Any = actors.sync
        sync.push(unwrapped, session.start_step)  # the copies start from the trainer's weights
        collect: Callable[..., Any] = actors.collect_groups
    else:
        client = _rollout_client(session, config)
        sync = make_weight_sync(client, config, accelerator=accel)  # rollout engine <- trainer weights, each step
        if session.start_step:  # resumed: the engine starts from the checkpoint's weights
            sync.push(unwrapped, session.start_step)
        collect = functools.partial(collect_groups, make_env,
                                    GraphPolicy(client, config.graph, config.sampling, dict(config.graph_options)))
    use_is = config.importance_sampling == "on" or (config.importance_sampling == "auto" and bool(config.rollout_model))
    ref_model = _frozen_copy(unwrapped) if config.beta > 0 else None
    spec = reward_spec(config)
    constraints = ConstraintSet(config.constraints)
    if constraints and session.start_step:
        constraints.load(config.output_dir, session.start_step)  # λ as it was at the checkpoint
    rank, total = accel.process_index, session.total_steps
    rng = random.Random(f"{config.seed}:{rank}")
    for _ in range(session.start_step):  # a resumed run draws the seeds it would have drawn
        [rng.randrange(config.train_seed_count) for _ in range(config.prompts_per_step)]

    def start_rollout(step: int) -> Any:
        seeds = [config.train_seed_start + rng.randrange(config.train_seed_count)
                 for _ in range(config.prompts_per_step)]
        return rollouts.submit(collect(seeds, config.num_generations, max_steps=config.max_env_steps,
                                       sample_seed=None if config.seed is None else
                                       config.seed * 7919 + step * 104729 + rank,
                                       concurrency=config.rollout_concurrency,
                                       metadata={"step": step, "env": config.env}))

    # The next batch's episodes may start during the update only where generation can be held
    # until the weights are updated (the live policy's client; see trainers/rollout_thread.py).
    prefetch = config.prefetch_rollouts and not config.rollout_model and isinstance(client, Pausable)  # not on Ray
    rollouts = RolloutThread()
    pending = None
    hold = contextlib.ExitStack()  # holds client.paused() from a prefetch until the update is done
    history: list[dict[str, float]] = []
    # The model, tokenizer, optimizer and imported modules live for the whole run: freezing them out
    # of the collector makes each full collection walk only what the steps allocate (unfrozen at
    # the end, so nothing outlives the run).
    gc.collect()
    gc.freeze()
    try:
        for step in range(session.start_step + 1, total + 1):  # step k trains on rollout batch k - 1
            t0 = time.perf_counter()
            if pending is None:
                unwrapped.eval()
                pending = start_rollout(step - 1)
            groups = pending.result()
            pending = None
            t_roll = time.perf_counter() - t0
            if prefetch:
                hold.enter_context(client.paused())
            if prefetch and step < total and not session.stop_requested:
                pending = start_rollout(step)  # its generation waits for hold to end
            pad = session.tokenizer.pad_token_id if session.tokenizer.pad_token_id is not None else 0
            costs = constraints.annotate([e for g in groups for e in g.episodes]) if constraints else []
            batch = build_batch(groups, constraints.reward_spec(spec) if constraints else spec,
                                scale=config.scale_rewards, gamma=config.gamma, turn_weight=config.turn_weight,
                                max_length=config.max_length, pad_id=pad, turn_baseline=config.turn_baseline,
                                missing_turn_rewards=config.missing_turn_rewards)
            if constraints:  # penalty R - Σλ·C is in the advantages; now the dual step on λ
                batch.stats.update(constraints.step(costs, batch.stats, reduce=_sum_over_processes(accel)))
                if session.is_main:
                    constraints.save(config.output_dir, step)
            batch = _on_device(batch, accel.device)
            session.record_trajectories([e.trajectory for g in groups for e in g.episodes], step - 1)
            if _nothing_to_train(batch, accel):  # e.g. every episode failed: report it, do not crash
                unwrapped.eval()
                hold.close()
                metrics = {**_episode_stats(groups, batch), "skipped_update": 1.0, "rollout_s": t_roll,
                           "step_s": time.perf_counter() - t0}
                history.append({"step": step, **metrics})
                session.log(step, metrics if session.logging_step(step) else {})
                session.state.step = step
                continue
            unwrapped.train()
            old, is_weights = _old_logps(policy, batch, config, use_is)
            ref = None if ref_model is None else sequence_logprobs(ref_model, batch, config.temperature,
                                                                   config.per_device_batch_size)
            t1 = time.perf_counter()
            for _ in range(config.num_iterations):
                objective = GRPOObjective(policy, batch, config, old_logps=old, ref_logps=ref, is_weights=is_weights)
                result = session.train_step(step, objective.micro_batches(), objective)
            m = {**objective.metrics, "grad_norm": result.grad_norm}
            t_train = time.perf_counter() - t1
            sync.push(unwrapped, step)
            unwrapped.eval()
            hold.close()  # the next batch's generation may start now
            tokens = float(batch.attention_mask.sum())
            metrics = {**_episode_stats(groups, batch), **m, "rollout_s": t_roll, "train_s": t_train,
                       "step_s": time.perf_counter() - t0,
                       "tokens_per_s": tokens / max(time.perf_counter() - t0, 1e-9),
                       "learning_rate": session.current_lr()}
            history.append({"step": step, **metrics})
            session.log(step, metrics if session.logging_step(step) else {})
            if on_step is not None:
                on_step(step, metrics)
            if session.end_step(step):  # Ctrl-C: saved; `resume: auto` continues
                break
    finally:
        rollouts.close()  # cancels a prefetched rollout that will not be trained on (before its generation can start)
        hold.close()
        gc.unfreeze()
        if actors is not None:
            actors.close()
    sync.close()
    return history


CONFIG_CLASS = GRPOConfig


def run_from_config(config: GRPOConfig) -> GRPOResult:
    return train_grpo(config)


__all__ = ["CONFIG_CLASS", "GRPOConfig", "GRPOResult", "GRPOObjective", "reward_spec", "run_from_config",
           "policy_logits", "policy_logprobs", "predicting_positions", "sequence_logprobs", "train_grpo", "LOSS_TYPES"]
