"""Supervised fine-tuning on conversations and recorded trajectories.

The loss is :func:`closedloop.trainers.losses.sft_loss` (TRL's, on identical tensors) on the tokens
the assistant produced. One optimizer step consumes a *global batch* of
``per_device_batch_size × gradient_accumulation_steps × processes`` examples (packed rows when
packing); every process knows the whole, seeded data order, takes its own slice, and divides its
loss by the trained-token count of the whole global batch (times the process count, undoing DDP's
gradient mean). So a step is the same whether it runs on one process with accumulation or on N
processes: ``tests/trainers/test_ddp.py`` checks this under ``torchrun`` with gloo.

Data order: epoch ``e`` is a permutation seeded by ``seed + e``; examples form one stream across
epochs and step ``s`` takes stream positions ``[s·G, (s+1)·G)``. The checkpoint records the
position (``samples_seen``), so a resumed run sees exactly the examples the uninterrupted run would.
``num_epochs`` therefore sets ``ceil(num_epochs · N / G)`` steps; a step may straddle two epochs.

Ctrl-C: the first SIGINT finishes the current step, saves ``checkpoint-<step>`` and returns with
``interrupted=True`` (``closedloop train`` then exits 130); ``resume: auto`` continues from it.

The step itself (accumulation with DDP ``no_sync``, autocast, clipping, the divergence stop, the
schedule), seeding, checkpoints, resume and metrics are :class:`~closedloop.trainers.session.TrainingSession`'s,
as for every trainer; this module is the data and the loss.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from closedloop.trainers.common import load_tokenizer, pad_token_id, world_size
from closedloop.trainers.config import SFTConfig, StoreSelection
from closedloop.trainers.data import (DataSchedule, Example, collate, examples_from_rows, examples_from_trajectories,
                                      load_chat_rows, load_store_trajectories, pack_examples, split_eval, truncate)
from closedloop.trainers.losses import sft_loss
from closedloop.trainers.session import TrainingSession, local_micro_batches

__all__ = ["CONFIG_CLASS", "SFTResult", "train_sft", "run_from_config", "build_examples"]

CONFIG_CLASS = SFTConfig


@dataclass
class SFTResult:
    """What a finished (or interrupted) SFT run left behind."""

    output_dir: Path
    run_id: str | None
    step: int
    metrics: dict[str, float]
    interrupted: bool = False
    checkpoint: Path | None = None
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    n_train: int = 0
    n_eval: int = 0

    @property
    def model_dir(self) -> Path:
        """The final model (an HF directory): ``output_dir`` itself."""
        return self.output_dir


def run_from_config(config: SFTConfig) -> SFTResult:
    """The ``closedloop train sft`` entry point."""
    return train_sft(config)


# --------------------------------------------------------------------------- data


def build_examples(config: SFTConfig, tokenizer: Any, trajectories: Iterable[Any] | None = None) -> list[Example]:
    """Tokenised examples from ``trajectories`` (Python objects) or ``config.dataset``."""
    if trajectories is not None:
        return examples_from_trajectories(trajectories, tokenizer, assistant_only_loss=config.assistant_only_loss)
    if config.dataset is None:
        raise ValueError("no training data: set `dataset` in the config or pass trajectories")
    if isinstance(config.dataset, StoreSelection):
        trajs = load_store_trajectories(config.dataset, config.store)
        if not trajs:
            raise ValueError(f"the run store holds no trajectories matching {config.dataset.model_dump(exclude_none=True)}")
        return examples_from_trajectories(trajs, tokenizer, assistant_only_loss=config.assistant_only_loss)
    rows = load_chat_rows(config.dataset)
    return examples_from_rows(rows, tokenizer, assistant_only_loss=config.assistant_only_loss,
                              completion_only_loss=config.completion_only_loss, source=Path(config.dataset).name)


# --------------------------------------------------------------------------- training


def train_sft(config: SFTConfig, trajectories: Iterable[Any] | None = None, *, model: Any = None,
              tokenizer: Any = None, on_step: Callable[[int, dict[str, float]], None] | None = None) -> SFTResult:
    """Fine-tune ``config.model`` (or ``model``/``tokenizer``) on ``trajectories`` or ``config.dataset``.

    ``on_step(step, metrics)`` is called on every process after each optimizer step (metrics are
    the logged ones at logging steps, else ``{}``). Returns an :class:`SFTResult`; the final model
    is saved in ``config.output_dir`` as an HF directory (merged weights with LoRA).
    """
    config.check_paths(model_given=model is not None and tokenizer is not None)
    tokenizer = load_tokenizer(config, tokenizer)
    pad_id = pad_token_id(tokenizer)
    examples, dropped = truncate(build_examples(config, tokenizer, trajectories), config.max_length)
    if not examples:
        raise ValueError("no example has an assistant token to train on (after truncation to max_length)")
    train_ex, eval_ex = split_eval(examples, config.eval_fraction, config.seed)
    rows = pack_examples(train_ex, config.max_length, pad_id) if config.packing and config.max_length else train_ex
    world = world_size()
    per_dev, accum = config.per_device_batch_size, config.gradient_accumulation_steps
    global_batch = per_dev * accum * world
    total_steps = config.max_steps or max(1, math.ceil(config.num_epochs * len(rows) / global_batch))
    schedule = DataSchedule(len(rows), config.seed, config.shuffle)

    with TrainingSession(config, kind="sft", model=model, tokenizer=tokenizer, total_steps=total_steps,
                         metadata={"n_examples": len(train_ex), "n_rows": len(rows), "world_size": world}) as session:
        if dropped:
            session.reporter.print(f"dropped {dropped} example(s) with no assistant token within max_length")
        accel, policy, state = session.accelerator, session.model, session.state
        device = accel.device
        window = torch.zeros(6, dtype=torch.float64, device=device)  # loss, correct, entropy·n, trained, tokens, steps
        window_start = time.perf_counter()
        policy.train()
        for step in range(session.start_step + 1, total_steps + 1):
            idx = schedule.take(state.samples_seen, global_batch)
            n_global = sum(rows[i].n_trained for i in idx)

            def loss_fn(micro: list[int]) -> torch.Tensor:
                batch = collate([rows[i] for i in micro], pad_id).to(device)
                logits = policy(**batch.model_inputs()).logits
                loss, m = sft_loss(logits.float(), batch.input_ids, batch.loss_mask, num_items_in_batch=n_global)
                n = m["num_tokens"].double()
                window[:5] += torch.stack([loss.detach().double(), m["mean_token_accuracy"].double() * n,
                                           m["entropy"].double() * n, n,
                                           torch.tensor(float(batch.n_tokens), dtype=torch.float64, device=device)])
                return loss * world  # normalised by the global batch's trained tokens; × world undoes DDP's mean

            result = session.train_step(step, local_micro_batches(idx, per_device=per_dev, accumulation=accum,
                                                                  world=world, rank=accel.process_index), loss_fn)
            window[5] += 1
            state.samples_seen += global_batch
            state.epoch = state.samples_seen / len(rows)

            logged: dict[str, float] = {}
            if session.logging_step(step):
                tot = accel.reduce(window.clone(), reduction="sum") if world > 1 else window
                elapsed = time.perf_counter() - window_start
                trained = max(float(tot[3]), 1.0)
                state.tokens_seen += int(tot[4])
                logged = {"loss": float(tot[0]) / float(window[5]), "lr": result.learning_rate,
                          "grad_norm": result.grad_norm, "mean_token_accuracy": float(tot[1]) / trained,
                          "entropy": float(tot[2]) / trained, "num_tokens": float(state.tokens_seen),
                          "tokens_per_s": float(tot[4]) / max(elapsed, 1e-9), "epoch": state.epoch}
                window.zero_()
                window_start = time.perf_counter()
            if eval_ex and ((config.eval_steps and step % config.eval_steps == 0) or step == total_steps):
                logged["eval_loss"] = evaluate(policy, eval_ex, config, pad_id, accel)
                policy.train()
                window_start = time.perf_counter()
            logged = session.log(step, logged)
            if on_step is not None:
                on_step(step, logged)
            t_end = time.perf_counter()
            if session.end_step(step):
                break
            window_start += time.perf_counter() - t_end  # a checkpoint's save is not training time
        if not session.interrupted:
            session.save_final()
    return SFTResult(output_dir=session.output_dir, run_id=session.run_id, step=state.step, metrics=state.metrics,
                     interrupted=session.interrupted, checkpoint=session.last_checkpoint,
                     history=session.reporter.history, n_train=len(train_ex), n_eval=len(eval_ex))


def evaluate(model: Any, examples: list[Example], config: SFTConfig, pad_id: int, accelerator: Any) -> float:
    """Mean token cross-entropy over the held-out examples' assistant tokens (sharded over processes)."""
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = examples[rank::world]
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for i in range(0, len(mine), config.per_device_batch_size):
            batch = collate(mine[i:i + config.per_device_batch_size], pad_id).to(accelerator.device)
            with accelerator.autocast():
                logits = model(**batch.model_inputs()).logits
            loss, m = sft_loss(logits.float(), batch.input_ids, batch.loss_mask)
            totals += torch.stack([loss.double() * m["num_tokens"].double(), m["num_tokens"].double()])
    if world > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    return float(totals[0] / totals[1].clamp(min=1))
