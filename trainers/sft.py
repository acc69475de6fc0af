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
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from closedloop.trainers.checkpoint import (InterruptGuard, TrainerState, load_checkpoint, resolve_resume,
                                            save_checkpoint, save_final_model)
from closedloop.trainers.common import (build_optimizer, build_scheduler, load_model_and_tokenizer, make_accelerator,
                                        open_run, pad_token_id, steps_logged, stop_if_diverged)
from closedloop.trainers.config import SFTConfig, StoreSelection, redacted_config
from closedloop.trainers.data import (Example, collate, examples_from_rows, examples_from_trajectories, load_chat_rows,
                                      load_store_trajectories, pack_examples, split_eval, truncate)
from closedloop.trainers.reporting import MetricsReporter, tensorboard_dir

__all__ = ["CONFIG_CLASS", "SFTResult", "train_sft", "run_from_config", "build_examples", "DataSchedule"]

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


class DataSchedule:
    """The seeded example stream (see the module docstring): which examples step ``s`` uses."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if n <= 0:
            raise ValueError("no training examples")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        import torch

        if epoch not in self._perms:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perms[epoch] = torch.randperm(self.n, generator=g).tolist()
            else:
                self._perms[epoch] = list(range(self.n))
            self._perms.pop(epoch - 2, None)
        return self._perms[epoch]

    def take(self, start: int, count: int) -> list[int]:
        """Example indices at stream positions ``[start, start + count)``."""
        return [self._perm(i // self.n)[i % self.n] for i in range(start, start + count)]


# --------------------------------------------------------------------------- training


def train_sft(config: SFTConfig, trajectories: Iterable[Any] | None = None, *, model: Any = None,
              tokenizer: Any = None, on_step: Callable[[int, dict[str, float]], None] | None = None) -> SFTResult:
    """Fine-tune ``config.model`` (or ``model``/``tokenizer``) on ``trajectories`` or ``config.dataset``.

    ``on_step(step, metrics)`` is called on every process after each optimizer step (metrics are
    the logged ones at logging steps, else ``{}``). Returns an :class:`SFTResult`; the final model
    is saved in ``config.output_dir`` as an HF directory (merged weights with LoRA).
    """
    import torch
    from accelerate.utils import set_seed

    from closedloop.trainers.losses import sft_loss

    config.check_paths(model_given=model is not None and tokenizer is not None)
    accelerator = make_accelerator(config)
    set_seed(config.seed)
    model, tokenizer = load_model_and_tokenizer(config, model, tokenizer)
    pad_id = pad_token_id(tokenizer)

    examples = build_examples(config, tokenizer, trajectories)
    examples, dropped = truncate(examples, config.max_length)
    if not examples:
        raise ValueError("no example has an assistant token to train on (after truncation to max_length)")
    train_ex, eval_ex = split_eval(examples, config.eval_fraction, config.seed)
    n_examples = len(train_ex)
    rows = pack_examples(train_ex, config.max_length, pad_id) if config.packing else train_ex

    world = accelerator.num_processes
    rank = accelerator.process_index
    per_dev, accum = config.per_device_batch_size, config.gradient_accumulation_steps
    global_batch = per_dev * accum * world
    total_steps = config.max_steps or max(1, math.ceil(config.num_epochs * len(rows) / global_batch))
    schedule = DataSchedule(len(rows), config.seed, config.shuffle)

    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)

    output_dir = Path(config.output_dir)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    state = TrainerState(trainer="sft")
    resume_from = resolve_resume(config.resume, output_dir)
    if resume_from is not None:
        state = load_checkpoint(resume_from, model=model, optimizer=optimizer, scheduler=scheduler,
                                accelerator=accelerator)
    store, run_id = open_run(config, "sft", accelerator, run_id=state.run_id,
                             metadata={"n_examples": n_examples, "n_rows": len(rows), "world_size": world})
    state.run_id = run_id if accelerator.is_main_process else state.run_id
    reporter: MetricsReporter | None = None

    def save(step_state: TrainerState) -> Path:
        return save_checkpoint(output_dir, step_state, model=model, tokenizer=tokenizer, optimizer=optimizer,
                               scheduler=scheduler, accelerator=accelerator, save_total_limit=config.save_total_limit,
                               config=config)

    device = accelerator.device
    window = torch.zeros(6, dtype=torch.float64, device=device)  # loss, correct, entropy·n, trained, tokens, steps
    last_metrics: dict[str, float] = dict(state.metrics)
    interrupted = False
    last_ckpt: Path | None = None
    status = "failed"
    error: Exception | None = None
    try:  # from here on the store run is open: whatever happens is recorded on it
        reporter = MetricsReporter(config.report_to, run_id=run_id, store=store,
                                   log_dir=tensorboard_dir(output_dir, config.run_name),
                                   run_name=config.run_name or output_dir.name, config=redacted_config(config),
                                   tags=config.tags, is_main_process=accelerator.is_main_process,
                                   replayed_through=steps_logged(store, run_id) if resume_from is not None else 0)
        if resume_from is not None:
            reporter.print(f"resumed from {resume_from} at step {state.step}")
        if dropped:
            reporter.print(f"dropped {dropped} example(s) with no assistant token within max_length")
        window_start = time.perf_counter()
        reporter.start(total_steps, "sft", completed=state.step)
        with InterruptGuard() as guard:
            model.train()
            while state.step < total_steps:
                idx = schedule.take(state.samples_seen, global_batch)
                micro = [[rows[i] for i in idx[(a * world + rank) * per_dev:(a * world + rank + 1) * per_dev]]
                         for a in range(accum)]
                n_global = sum(rows[i].n_trained for i in idx)
                step_loss = torch.zeros((), dtype=torch.float64, device=device)
                for a, exs in enumerate(micro):
                    batch = collate(exs, pad_id).to(device)
                    sync = a == accum - 1
                    ctx = accelerator.no_sync(model) if not sync and world > 1 else _null()
                    with ctx, accelerator.autocast():
                        logits = model(**batch.model_inputs()).logits
                        loss, m = sft_loss(logits.float(), batch.input_ids, batch.loss_mask,
                                           num_items_in_batch=n_global)
                    accelerator.backward(loss * world)
                    step_loss += loss.detach().double()
                    n = m["num_tokens"].double()
                    window += torch.stack([loss.detach().double(), m["mean_token_accuracy"].double() * n,
                                           m["entropy"].double() * n, n,
                                           torch.tensor(float(batch.n_tokens), dtype=torch.float64, device=device),
                                           torch.tensor(0.0, dtype=torch.float64, device=device)])
                clip = config.max_grad_norm if config.max_grad_norm and config.max_grad_norm > 0 else float("inf")
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip)
                stop_if_diverged(state.step + 1, accelerator, loss=step_loss, grad_norm=grad_norm)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                window[5] += 1
                state.step += 1
                state.samples_seen += global_batch
                state.epoch = state.samples_seen / len(rows)
                reporter.advance(state.step)

                logged: dict[str, float] = {}
                last = state.step >= total_steps
                if state.step % config.logging_steps == 0 or last:
                    tot = accelerator.reduce(window.clone(), reduction="sum") if world > 1 else window
                    steps = float(window[5])  # the same on every rank
                    elapsed = time.perf_counter() - window_start
                    trained = max(float(tot[3]), 1.0)
                    state.tokens_seen += int(tot[4])
                    logged = {"loss": float(tot[0]) / steps, "lr": lr, "grad_norm": float(grad_norm),
                              "mean_token_accuracy": float(tot[1]) / trained, "entropy": float(tot[2]) / trained,
                              "num_tokens": float(state.tokens_seen), "tokens_per_s": float(tot[4]) / max(elapsed, 1e-9),
                              "epoch": state.epoch}
                    window.zero_()
                    window_start = time.perf_counter()
                if eval_ex and ((config.eval_steps and state.step % config.eval_steps == 0) or last):
                    logged["eval_loss"] = evaluate(model, eval_ex, config, pad_id, accelerator)
                    model.train()
                    window_start = time.perf_counter()
                if logged:
                    state.metrics = last_metrics = reporter.log(state.step, logged)
                if on_step is not None:
                    on_step(state.step, logged)
                stop = guard.should_stop(accelerator)
                if stop or (config.save_steps and state.step % config.save_steps == 0 and not last):
                    last_ckpt = save(state)
                    if stop:
                        interrupted = True
                        reporter.print(f"interrupted: saved {last_ckpt}; continue with resume=auto")
                        break
                    window_start = time.perf_counter()
            if not interrupted:
                if last_ckpt is None or not last_ckpt.name.endswith(f"-{state.step}"):
                    last_ckpt = save(state)
                save_final_model(model, tokenizer, output_dir, accelerator=accelerator)
        status = "interrupted" if interrupted else "completed"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as e:
        error = e
        raise
    finally:
        if reporter is not None:
            reporter.close()
        if store is not None and run_id is not None:
            try:
                store.finish_run(run_id, status, outcome={"step": state.step, "metrics": last_metrics,
                                                          "output_dir": str(output_dir)}, error=error)
            except Exception:  # never mask the training error with a bookkeeping one
                pass
    assert reporter is not None  # set first thing in the try, which completed
    return SFTResult(output_dir=output_dir, run_id=run_id, step=state.step, metrics=last_metrics,
                     interrupted=interrupted, checkpoint=last_ckpt, history=reporter.history,
                     n_train=n_examples, n_eval=len(eval_ex))


def evaluate(model: Any, examples: list[Example], config: SFTConfig, pad_id: int, accelerator: Any) -> float:
    """Mean token cross-entropy over the held-out examples' assistant tokens (sharded over processes)."""
    import torch

    from closedloop.trainers.losses import sft_loss

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


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
