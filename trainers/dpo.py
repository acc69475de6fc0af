"""Direct Preference Optimization (sigmoid, hinge, IPO), and the loop the constrained variant shares.

One step consumes ``per_device_batch_size × gradient_accumulation_steps × processes`` pairs from the
seeded stream of :class:`closedloop.trainers.data.DataSchedule`; chosen and rejected sequences go
through the policy in one ``[2B, T]`` forward pass (TRL's layout), their completion log-probs are
summed, and the per-pair losses of :mod:`.preference_loss` are averaged over the whole global
batch (so one step is the same however the batch is split over micro-batches and processes).

The reference log-probs come, in order, from the data (``ref_chosen_logps``/``ref_rejected_logps``
on every row), from ``ref_model``, or from a frozen copy of the starting policy (with LoRA: the
policy with its adapter disabled, as TRL). ``precompute_ref_log_probs`` scores every pair once
before training and frees the reference model. The optimizer step, checkpoints, Ctrl-C and
metrics are :class:`~closedloop.trainers.session.TrainingSession`'s.
"""

from __future__ import annotations

import copy
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

import torch
from pydantic import Field, ValidationInfo, field_validator

from closedloop.trainers.common import load_tokenizer, pad_token_id, world_size
from closedloop.trainers.config import TrainConfig, checking_paths, dataset_usable, model_path
from closedloop.trainers.data import DataSchedule
from closedloop.trainers.preference_data import (PreferenceBatch, PreferenceExample, PreferenceStoreSelection,
                                                 collate_pairs, encode_preference_rows, load_preference_rows,
                                                 parse_preference_store_spec, store_preference_rows)
from closedloop.trainers.preference_loss import dpo_losses, preference_metrics
from closedloop.trainers.preflight import check_model_dir
from closedloop.trainers.session import TrainingSession, local_micro_batches

__all__ = ["CONFIG_CLASS", "PreferenceConfig", "DPOConfig", "PreferenceResult", "train_dpo", "train_preference",
           "run_from_config", "build_pairs", "pair_logps", "policy_margins"]


class PreferenceConfig(TrainConfig):
    """What every pairwise preference trainer shares: data, reference, β and TRL's DPO defaults."""

    dataset: str | PreferenceStoreSelection | None = Field(
        None, description="Preference pairs: a .jsonl/.json/.parquet file or datasets directory of TRL preference "
                          "rows ({'prompt', 'chosen', 'rejected'} as messages or text, optional 'tools', optional "
                          "'ref_chosen_logps'/'ref_rejected_logps'); or episodes from the run store paired by task, "
                          "written `store:graph=react,strategy=best_worst,min_margin=0.5` or {store: {...}}. Null "
                          "when rows are passed in Python.")
    beta: float = Field(0.1, gt=0, description="β: strength of the implicit KL to the reference (TRL default 0.1; "
                                               "the IPO regulariser τ for loss_type ipo).")
    ref_model: str | None = Field(None, description="Reference model directory / hub id; null: a frozen copy of the "
                                                    "starting policy (with LoRA: the policy with adapters off).")
    precompute_ref_log_probs: bool = Field(False, description="Score every pair with the reference once before "
                                                              "training, then free it (TRL's option).")
    length_normalize: bool = Field(False, description="Divide each completion's log-prob by its length before the "
                                                      "loss (TRL's sigmoid_norm for sigmoid; IPO always does).")
    learning_rate: float = Field(1e-6, gt=0, description="Peak AdamW learning rate (TRL DPOConfig default 1e-6).")
    max_length: int | None = Field(1024, ge=2, description="Truncate prompt+completion to this many tokens, keeping "
                                                           "the start (TRL DPOConfig default 1024).")
    shuffle: bool = Field(True, description="Shuffle pairs each epoch (seeded by seed + epoch).")
    disable_dropout: bool = Field(True, description="Set every torch Dropout to p=0 in the policy and reference "
                                                    "(TRL DPOConfig default), so both score a pair the same way "
                                                    "at the start.")
    save_steps: int | None = Field(None, ge=1, description="Checkpoint every this many steps (null: at the end).")

    @field_validator("dataset", mode="before")
    @classmethod
    def _dataset_spec(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and set(value) == {"store"}:
            return PreferenceStoreSelection.model_validate(value["store"] or {})
        if isinstance(value, str) and value.startswith("store:"):
            return parse_preference_store_spec(value)
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        return value

    _dataset_exists = field_validator("dataset")(dataset_usable)

    @field_validator("ref_model")
    @classmethod
    def _ref_model_exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and checking_paths(info):
            check_model_dir(model_path(value), what="ref_model")
        return value

    def pair_losses(self, logps: torch.Tensor, ref_logps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} defines no pair loss: use DPOConfig or ConstrainedPreferenceConfig")


class DPOConfig(PreferenceConfig):
    """DPO (Rafailov et al. 2023) and its hinge (SLiC) and IPO variants, as TRL's ``DPOTrainer``."""

    loss_type: Literal["sigmoid", "hinge", "ipo"] = Field("sigmoid", description="sigmoid (DPO), hinge (SLiC), "
                                                                                 "ipo (IPO, length-normalised).")

    def pair_losses(self, logps: torch.Tensor, ref_logps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Per-pair losses from ``[2B]`` policy/reference log-probs and lengths (chosen first)."""
        c, r = logps.chunk(2)
        rc, rr = ref_logps.chunk(2)
        lc, lr = lengths.chunk(2)
        return dpo_losses(c, r, rc, rr, beta=self.beta, loss_type=self.loss_type, chosen_lengths=lc,
                          rejected_lengths=lr, length_normalize=self.length_normalize)


@dataclass
class PreferenceResult:
    """What a finished (or interrupted) preference run left behind."""

    output_dir: Path
    run_id: str | None
    step: int
    metrics: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)
    interrupted: bool = False
    n_pairs: int = 0


def build_pairs(config: PreferenceConfig, tokenizer: Any, rows: Iterable[dict[str, Any]] | None = None
                ) -> list[PreferenceExample]:
    """Tokenised pairs from ``rows`` (Python) or ``config.dataset`` (a file or the run store)."""
    if rows is not None:
        return encode_preference_rows(list(rows), tokenizer)
    if config.dataset is None:
        raise ValueError("no preference data: set `dataset` in the config or pass rows")
    if isinstance(config.dataset, PreferenceStoreSelection):
        found = store_preference_rows(config.dataset, config.store)
        if not found:
            raise ValueError(f"the run store holds no pair of same-task episodes with different rewards matching "
                             f"{config.dataset.model_dump(exclude_none=True)}")
        return encode_preference_rows(found, tokenizer, source="store")
    return encode_preference_rows(load_preference_rows(config.dataset), tokenizer, source=Path(config.dataset).name)


def pair_logps(model: Any, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs ``[2B]`` and completion lengths ``[2B]`` under ``model``.

    Log-probs come from ``cross_entropy`` on the completion positions only (the same numbers as
    :func:`~closedloop.trainers.losses.token_logprobs`). On a left-padded batch every completion
    ends at the last column, so the LM head runs only on the last ``K + 1`` positions
    (``logits_to_keep``, K = the longest completion in the batch) instead of every prompt token.
    """
    import torch.nn.functional as F

    kwargs: dict[str, Any] = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                              "use_cache": False}
    mask = batch.completion_mask[:, 1:].bool()
    labels = batch.input_ids[:, 1:].masked_fill(~mask, -100)
    if batch.position_ids is not None:  # left-padded: completions occupy the last columns
        cols = mask.any(0).nonzero()
        keep = int(mask.size(1) - cols[0]) if cols.numel() else 1
        kwargs.update(position_ids=batch.position_ids, logits_to_keep=keep + 1)
        logits = model(**kwargs).logits[:, :-1]
        labels = labels[:, labels.size(1) - keep:] if keep else labels[:, :0]
    else:
        logits = model(**kwargs).logits[:, :-1]
    nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)
    logps = -nll.view(labels.shape).sum(-1)
    return logps, mask.sum(-1).to(logps.dtype)


def policy_margins(model: Any, pairs: list[PreferenceExample], pad_id: int, *, length_normalize: bool,
                   max_length: int | None = None, batch_size: int = 16) -> torch.Tensor:
    """Δθ per pair (ℓ(y_w) − ℓ(y_l), length-normalised or not) under ``model``, without gradient."""
    device = next(model.parameters()).device
    out = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(pairs), batch_size):
            batch = collate_pairs(pairs[i:i + batch_size], pad_id, max_length, padding_side="left").to(device)
            logps, lengths = pair_logps(model, batch)
            if length_normalize:
                logps = logps / lengths.clamp(min=1)
            c, r = logps.chunk(2)
            out.append(c - r)
    model.train(was_training)
    return torch.cat(out)


def _reference(config: PreferenceConfig, policy: Any, resumed: bool, device: Any) -> tuple[Any, Callable[[], Any]]:
    """(reference model or None, context manager to score with it). None + adapter-off context for LoRA."""
    if config.ref_model is not None or resumed:
        from transformers import AutoModelForCausalLM

        path = model_path(config.ref_model) if config.ref_model else config.model_path
        dtype = "auto" if config.dtype == "auto" else getattr(torch, config.dtype)
        if config.lora is not None and not config.ref_model:
            return None, lambda: policy.disable_adapter()
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    elif config.lora is not None:
        return None, lambda: policy.disable_adapter()
    else:
        ref = copy.deepcopy(policy)
    ref.to(device).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref, nullcontext


def _disable_dropout(model: Any) -> None:
    for module in model.modules():  # TRL's disable_dropout_in_model
        if isinstance(module, torch.nn.Dropout):
            module.p = 0


def _ref_logps(ref: Any, policy: Any, ctx: Callable[[], Any], batch: PreferenceBatch) -> torch.Tensor:
    with torch.no_grad(), ctx():
        return pair_logps(ref if ref is not None else policy, batch)[0]


def train_preference(config: PreferenceConfig, rows: Iterable[dict[str, Any]] | None = None, *, model: Any = None,
                     tokenizer: Any = None, kind: str = "dpo",
                     on_step: Callable[[int, dict[str, float]], None] | None = None) -> PreferenceResult:
    """Train on preference pairs with ``config.pair_losses`` (DPO or the constrained variant)."""
    config.check_paths(model_given=model is not None and tokenizer is not None)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    tokenizer = load_tokenizer(config, tokenizer)
    pairs = build_pairs(config, tokenizer, rows)
    if not pairs:
        raise ValueError("no preference pairs to train on")
    world = world_size()
    per_dev, accum = config.per_device_batch_size, config.gradient_accumulation_steps
    global_batch = per_dev * accum * world
    total = config.max_steps or max(1, math.ceil(config.num_epochs * len(pairs) / global_batch))
    schedule = DataSchedule(len(pairs), config.seed, config.shuffle)
    history: list[dict[str, float]] = []
    metrics: dict[str, float] = {}
    with TrainingSession(config, kind=kind, model=model, tokenizer=tokenizer, total_steps=total) as session:
        accel, policy = session.accelerator, session.model
        if config.disable_dropout:
            _disable_dropout(session.unwrapped_model)
        device, pad_id = accel.device, pad_token_id(session.tokenizer)
        score_ref = _reference_scorer(config, pairs, session, pad_id)
        policy.train()
        for step in range(session.start_step + 1, total + 1):
            t0 = time.perf_counter()
            sums: dict[str, float] = {}
            n_tokens = 0

            def loss_fn(micro: list[int]) -> torch.Tensor:
                nonlocal n_tokens
                batch = collate_pairs([pairs[i] for i in micro], pad_id, config.max_length,
                                      padding_side="left").to(device)
                n_tokens += batch.n_tokens
                logps, lengths = pair_logps(policy, batch)
                ref_logps = score_ref(batch).to(logps.dtype)
                losses = config.pair_losses(logps, ref_logps, lengths)
                c, r = logps.detach().chunk(2)
                rc, rr = ref_logps.chunk(2)
                lc, lr = lengths.chunk(2)
                m = preference_metrics(c, r, rc, rr, beta=config.beta, chosen_lengths=lc, rejected_lengths=lr,
                                       length_normalize=config.length_normalize)
                m["loss"] = losses.detach().sum()
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                return losses.sum() / global_batch * world  # the mean over the global batch; × world undoes DDP's mean

            idx = schedule.take((step - 1) * global_batch, global_batch)
            result = session.train_step(step, local_micro_batches(idx, per_device=per_dev, accumulation=accum,
                                                                  world=world, rank=accel.process_index), loss_fn)
            if world > 1:
                keys = sorted(sums)
                tot = accel.reduce(torch.tensor([sums[k] for k in keys] + [float(n_tokens)], device=device,
                                                dtype=torch.float64), reduction="sum")
                sums, n_tokens = {k: float(v) for k, v in zip(keys, tot[:-1])}, int(tot[-1])
            elapsed = time.perf_counter() - t0
            metrics = {k: v / global_batch for k, v in sums.items()}
            metrics.update({"grad_norm": result.grad_norm, "learning_rate": result.learning_rate, "step_s": elapsed,
                            "tokens_per_s": n_tokens / max(elapsed, 1e-9), "epoch": step * global_batch / len(pairs)})
            history.append({"step": step, **metrics})
            session.log(step, metrics if session.logging_step(step) else {})
            if on_step is not None:
                on_step(step, metrics)
            if session.end_step(step):
                break
        if not session.interrupted:
            session.save_final()
    return PreferenceResult(Path(config.output_dir), session.run_id, session.state.step, metrics, history,
                            session.interrupted, n_pairs=len(pairs))


def _reference_scorer(config: PreferenceConfig, pairs: list[PreferenceExample], session: TrainingSession,
                      pad_id: int) -> Callable[[PreferenceBatch], torch.Tensor]:
    """The reference log-probs of a batch ``[2B]``: from the rows, or scored by the reference (once
    before training with ``precompute_ref_log_probs``, which fills the rows and frees it)."""
    have_refs = all(p.ref_chosen_logps is not None for p in pairs)
    if not have_refs and any(p.ref_chosen_logps is not None for p in pairs):
        raise ValueError("some rows carry ref_chosen_logps/ref_rejected_logps and others do not; give them on "
                         "every row or on none")
    if have_refs:
        return lambda batch: batch.ref_logps
    policy, device = session.model, session.accelerator.device
    ref, ref_ctx = _reference(config, session.unwrapped_model, session.start_step > 0, device)
    if not config.precompute_ref_log_probs:
        return lambda batch: _ref_logps(ref, policy, ref_ctx, batch)
    per_dev = config.per_device_batch_size
    for i in range(0, len(pairs), per_dev):
        chunk = pairs[i:i + per_dev]
        lp = _ref_logps(ref, policy, ref_ctx, collate_pairs(chunk, pad_id, config.max_length,
                                                           padding_side="left").to(device))
        for p, c, r in zip(chunk, *lp.float().cpu().chunk(2)):
            p.ref_chosen_logps, p.ref_rejected_logps = float(c), float(r)
    return lambda batch: batch.ref_logps


def train_dpo(config: DPOConfig, rows: Iterable[dict[str, Any]] | None = None, *, model: Any = None,
              tokenizer: Any = None, on_step: Callable[[int, dict[str, float]], None] | None = None) -> PreferenceResult:
    """DPO on ``rows`` (TRL preference rows) or ``config.dataset``; the final model goes to ``output_dir``."""
    return train_preference(config, rows, model=model, tokenizer=tokenizer, kind="dpo", on_step=on_step)


CONFIG_CLASS = DPOConfig


def run_from_config(config: DPOConfig) -> PreferenceResult:
    """The ``closedloop train dpo`` entry point."""
    return train_dpo(config)
