"""The training session: what every training loop needs besides its data and its loss, and the
optimizer step itself, written once for SFT, GRPO, DPO, constrained PO (and so for RFT and the
latency recipe, which run GRPO and SFT).

A trainer module is its config plus a loop that reads top to bottom (TRL's lesson: the loss on one
screen); the plumbing lives here::

    with TrainingSession(config, kind="sft", total_steps=n) as session:
        for step in range(session.start_step + 1, n + 1):
            result = session.train_step(step, micro_batches, loss_fn)  # accumulate, clip, check, apply
            session.log(step, metrics if session.logging_step(step) else {})
            if session.end_step(step):                                   # checkpoint when due; Ctrl-C
                break
        if not session.interrupted:
            session.save_final()

The rules, one of each:

- **seeding**: ``accelerate.utils.set_seed(config.seed)`` (Python, NumPy, torch, CUDA: what
  transformers' ``Trainer`` and TRL do) before the model loads, since LoRA's initialisation draws
  from torch's generator. Data order and rollout seeds have their own seeded generators.
- **accumulation**: one optimizer step runs the trainer's micro-batches one after another, forward
  and backward; under DDP all but the last run under ``no_sync``, so gradients are all-reduced once
  per step (and every process makes exactly one all-reduce, however many micro-batches it has).
  Each micro-batch's loss comes from the trainer already normalised (SFT and DPO: by the whole
  global batch, times the process count to undo DDP's mean; GRPO: by its loss type's rule over the
  process's rollout batch), because the normalisation is part of the loss, not of the plumbing.
- **precision**: each micro-batch's forward and loss run under ``accelerator.autocast()``
  (``mixed_precision``; a no-op for ``no``).
- **clipping**: ``accelerator.clip_grad_norm_`` over the trainable parameters (``requires_grad``),
  bounded by ``max_grad_norm``, or by infinity when that is null or <= 0, so the norm is still
  computed and logged, the same way, also where only accelerate knows how (fp16 gradients unscaled
  first, FSDP's sharded norm). Frozen parameters (a LoRA base) have no gradient, so this norm equals
  the norm over all parameters; with full fine-tuning the two lists are the same.
- **divergence**: a NaN or infinite loss or gradient norm stops the run before the optimizer applies
  the step (:class:`~closedloop.trainers.common.TrainingDivergedError`; processes agree).
- **scheduling**: the LR scheduler steps once per optimizer step (it is not passed through
  ``accelerator.prepare``: see :mod:`.common`).
- **checkpoints**: every ``save_steps`` (not at the last step: the final save writes that one),
  with the :class:`~closedloop.trainers.checkpoint.TrainerState` the loop keeps (data position);
  ``resume`` continues from one. **Ctrl-C**: the first finishes the step, saves and stops
  (:attr:`interrupted`); a second interrupts at once.
- **metrics**: at ``logging_steps`` and the last step, to the configured sinks; a run resumed from
  a checkpoint older than its last logged step trains the steps in between again without logging
  them twice. Only the main process writes the store, metrics and checkpoints.
- **the store run**: opened with the session and closed when the ``with`` block ends, as
  ``completed``, ``interrupted`` or ``failed`` with the error, never left ``running``.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch

from closedloop.messages import Trajectory
from closedloop.trainers.checkpoint import (InterruptGuard, TrainerState, load_checkpoint, resolve_resume,
                                            save_checkpoint, save_final_model)
from closedloop.trainers.common import (build_optimizer, build_scheduler, fewer_processes_warning,
                                        load_model_and_tokenizer, make_accelerator, open_run, steps_logged,
                                        stop_if_diverged, world_size)
from closedloop.trainers.config import TrainConfig, redacted_config
from closedloop.trainers.reporting import MetricsReporter, tensorboard_dir

__all__ = ["TrainingSession", "StepResult", "local_micro_batches"]

M = TypeVar("M")


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports."""

    loss: float  #: the sum of the micro-batch losses this process backpropagated
    grad_norm: float  #: the gradient norm before clipping (of the gradients all processes share)
    learning_rate: float  #: the rate this step applied


def local_micro_batches(indices: Sequence[int], *, per_device: int, accumulation: int, world: int,
                        rank: int) -> list[list[int]]:
    """This process's micro-batches of a global batch (``per_device × accumulation × world``
    indices): micro-batch ``a`` of rank ``r`` is the slice ``(a·world + r)·per_device`` onward, so
    the same global batch is one step on one process with accumulation or on N processes."""
    return [list(indices[(a * world + rank) * per_device:(a * world + rank + 1) * per_device])
            for a in range(accumulation)]


class TrainingSession:
    """Model, optimizer, schedule, accelerator, run store, sinks and checkpoints of one training
    run, and its optimizer step (:meth:`train_step`). Use it as a context manager: leaving the
    block closes the sinks and the store run with the outcome.

    ``kind`` names the trainer on the store's ``kind="train"`` run (``sft``, ``grpo``, ``dpo``, ...);
    rollout trajectories are recorded as its child runs (:meth:`record_trajectories`).
    ``total_steps``: the loop's steps (default ``config.max_steps``); ``optimizer_steps``: the
    optimizer steps the schedule spans, when a loop step makes several (GRPO's ``num_iterations``).
    ``metadata`` goes on the store run.
    """

    def __init__(self, config: TrainConfig, *, kind: str, model: Any = None, tokenizer: Any = None,
                 total_steps: int | None = None, optimizer_steps: int | None = None,
                 metadata: dict[str, Any] | None = None) -> None:
        from accelerate.utils import set_seed

        self.config = config
        self.kind = kind
        self.total_steps = total_steps or config.max_steps or 1
        self.accelerator = make_accelerator(config)
        fewer = fewer_processes_warning()
        if fewer and self.accelerator.is_main_process:
            print(fewer, file=sys.stderr, flush=True)
        if self.accelerator.num_processes != world_size():
            raise RuntimeError(f"WORLD_SIZE={world_size()} but accelerate runs {self.accelerator.num_processes} "
                               f"processes")
        set_seed(config.seed)
        model, tokenizer = load_model_and_tokenizer(config, model, tokenizer)
        self.tokenizer = tokenizer
        optimizer = build_optimizer(model, config)
        self.scheduler = build_scheduler(optimizer, config, optimizer_steps or self.total_steps)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.output_dir = Path(config.output_dir)
        self.state = TrainerState(trainer=kind)
        self.last_checkpoint: Path | None = None
        self.interrupted = False
        self._guard = InterruptGuard()
        self._finished = False
        resumed_from = self._resume()
        self.start_step = self.state.step
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self.store, self.run_id = open_run(config, kind, self.accelerator, run_id=self.state.run_id,
                                           metadata=metadata)
        try:
            self.reporter = MetricsReporter(
                config.report_to, run_id=self.run_id, store=self.store,
                log_dir=tensorboard_dir(config.output_dir, config.run_name), run_name=config.run_name
                or self.output_dir.name, config=redacted_config(config), tags=config.tags,
                is_main_process=self.is_main, replayed_through=steps_logged(self.store, self.run_id)
                if resumed_from is not None else 0)
        except Exception as e:  # the run is open in the store: record why it ended, not leave it "running"
            if self.store is not None and self.run_id is not None:
                self.store.finish_run(self.run_id, "failed", error=e)
            raise
        if resumed_from is not None:
            self.reporter.print(f"resumed from {resumed_from} at step {self.start_step}")

    # ------------------------------------------------------------------ lifetime

    def __enter__(self) -> "TrainingSession":
        self._guard.__enter__()
        self.reporter.start(self.total_steps, description=self.kind, completed=self.start_step)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._guard.__exit__(exc_type, exc, tb)
        if exc is None:
            self.finish("interrupted" if self.interrupted else "completed")
            return
        try:  # never mask the training error with a bookkeeping one
            self.finish("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed",
                        error=exc if isinstance(exc, Exception) else None)
        except Exception:
            pass

    def finish(self, status: str = "completed", error: BaseException | None = None) -> None:
        """Close the sinks and the store run, with ``error`` (what stopped a failed run) recorded.
        Only the first call counts (a failure while finishing is not recorded over the outcome)."""
        if self._finished:
            return
        self._finished = True
        self.reporter.close()
        if self.store is not None and self.run_id is not None:
            last = self.reporter.history[-1][1] if self.reporter.history else {}
            self.store.finish_run(self.run_id, status, outcome={"steps": self.state.step, "final_metrics": last,
                                                                "output_dir": str(self.output_dir)}, error=error)

    @property
    def is_main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    @property
    def stop_requested(self) -> bool:
        """A Ctrl-C arrived (on this process); :meth:`end_step` will stop the run."""
        return self._guard.requested

    @property
    def unwrapped_model(self) -> Any:
        """The model without its DDP/accelerate wrapper (what a rollout client or a save uses)."""
        return self.accelerator.unwrap_model(self.model)

    # ------------------------------------------------------------------ the step

    def train_step(self, step: int, micro_batches: Sequence[M], loss_fn: Callable[[M], torch.Tensor]) -> StepResult:
        """One optimizer step over this process's ``micro_batches``: ``loss_fn(micro_batch)`` returns
        the (already normalised) loss to backpropagate; then clip, check for divergence (``step``
        names the step in the error), apply the optimizer and the schedule, and clear the gradients."""
        accel = self.accelerator
        last = len(micro_batches) - 1
        total = torch.zeros((), dtype=torch.float64, device=accel.device)
        for i, micro in enumerate(micro_batches):
            with accel.no_sync(self.model) if i < last and accel.num_processes > 1 else nullcontext():
                with accel.autocast():
                    loss = loss_fn(micro)
                accel.backward(loss)
            total += loss.detach().double()
        grad_norm = self.clip_gradients()
        stop_if_diverged(step, accel, loss=total, grad_norm=grad_norm)
        lr = self.current_lr()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss=float(total), grad_norm=grad_norm, learning_rate=lr)

    def clip_gradients(self) -> float:
        """Clip the gradients of the trainable parameters to ``max_grad_norm`` (none: infinity) and
        return their norm before clipping (see the module docstring for why this one way)."""
        max_norm = self.config.max_grad_norm
        bound = max_norm if max_norm is not None and max_norm > 0 else float("inf")
        params = [p for p in self.model.parameters() if p.requires_grad]
        return float(self.accelerator.clip_grad_norm_(params, bound))

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ bookkeeping

    def record_trajectories(self, trajectories: Iterable[Trajectory], step: int) -> None:
        """Every rollout lands in the store as a child run of this training run (one transaction)."""
        if self.store is None or self.run_id is None:
            return
        self.store.record_trajectories(list(trajectories), kind="rollout", parent_id=self.run_id,
                                       tags=[f"step:{step}"])

    def logging_step(self, step: int) -> bool:
        """Whether ``step`` reports metrics: every ``logging_steps`` and the last step."""
        return step % self.config.logging_steps == 0 or step >= self.total_steps

    def log(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Report ``metrics`` at ``step`` (nothing when empty; the caller decides when, see
        :meth:`logging_step`) and move the progress bar. Returns the scalars logged."""
        logged = self.reporter.log(step, metrics) if metrics else {}
        if logged:
            self.state.metrics = logged
        self.reporter.advance(step)
        return logged

    # ------------------------------------------------------------------ checkpoints

    def _resume(self) -> Path | None:
        where = resolve_resume(self.config.resume, self.output_dir)
        if where is not None:
            self.state = load_checkpoint(where, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                         accelerator=self.accelerator)
        return where

    def end_step(self, step: int) -> bool:
        """After step ``step``: on Ctrl-C save a checkpoint and return True (the loop stops; ``resume:
        auto`` continues from it), else save one when ``save_steps`` says so. Every process calls it."""
        self.state.step = step
        if self._guard.should_stop(self.accelerator):
            self.save(interrupted=True)
            self.interrupted = True
            self.reporter.print(f"interrupted: saved {self.last_checkpoint}; continue with resume=auto")
            return True
        if self.config.save_steps and step % self.config.save_steps == 0 and step < self.total_steps:
            self.save()
        return False

    def save(self, *, interrupted: bool = False) -> Path:
        """A resumable checkpoint of the current :attr:`state` (every process must call it)."""
        state = self.state.model_copy(update={"run_id": self.run_id or self.state.run_id,
                                              "extra": {**self.state.extra, "interrupted": interrupted}})
        self.last_checkpoint = save_checkpoint(
            self.output_dir, state, model=self.model, tokenizer=self.tokenizer, optimizer=self.optimizer,
            scheduler=self.scheduler, accelerator=self.accelerator, save_total_limit=self.config.save_total_limit,
            config=self.config)
        return self.last_checkpoint

    def save_final(self) -> Path:
        """The last resumable checkpoint (unless it was just written), and the final model as a plain HF
        directory in ``output_dir`` itself that ``hf:`` and ``closedloop serve`` load."""
        if self.last_checkpoint is None or self.last_checkpoint.name != f"checkpoint-{self.state.step}":
            self.save()
        save_final_model(self.model, self.tokenizer, self.output_dir, accelerator=self.accelerator)
        return self.output_dir
