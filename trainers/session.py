"""What every training loop needs besides its loss: model, accelerator, optimizer, schedule,
run store, metric sinks and checkpoints, set up once from a :class:`TrainConfig`.

The loop stays readable (TRL's lesson: a trainer is a config plus a loss on one screen) because
this plumbing lives here. Devices, mixed precision and DDP/FSDP/DeepSpeed go through
``accelerate`` (the loop runs unchanged under ``accelerate launch``/``torchrun``), LoRA through
``peft``. Only the main process writes the store, metrics and checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch

from closedloop.messages import Trajectory
from closedloop.trainers.common import build_optimizer, build_scheduler, load_model_and_tokenizer, make_accelerator, \
    open_run, steps_logged, stop_if_diverged
from closedloop.trainers.config import TrainConfig, redacted_config


class TrainingSession:
    """Model, optimizer, schedule, accelerator, run store and sinks for one training run.

    ``kind`` names the run in the store (``sft``, ``grpo``: the trainer recorded on the ``kind="train"`` run); rollout trajectories are
    recorded as its child runs, metrics with :meth:`log`.
    """

    def __init__(self, config: TrainConfig, *, kind: str, model: Any = None, tokenizer: Any = None,
                 total_optimizer_steps: int | None = None) -> None:
        self.config = config
        self.accelerator = make_accelerator(config)
        torch.manual_seed(config.seed)
        model, tokenizer = load_model_and_tokenizer(config, model, tokenizer)
        self.tokenizer = tokenizer
        total = total_optimizer_steps or (config.max_steps or 1) * int(getattr(config, "num_iterations", 1))
        optimizer = build_optimizer(model, config)
        # The scheduler is stepped by the loop once per optimizer step, not prepared (see common.py).
        self.scheduler = build_scheduler(optimizer, config, total)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.output_dir = Path(config.output_dir)
        self.step = 0
        self.start_step = 0
        self.kind = kind
        self.run_id: str | None = None
        self.store = None
        self.resumed_state = None
        self._finished = False
        self._resume()
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        previous = self.resumed_state.run_id if self.resumed_state is not None else None
        self.store, self.run_id = open_run(config, kind, self.accelerator, run_id=previous)
        from closedloop.trainers.reporting import MetricsReporter, tensorboard_dir

        try:
            self.reporter = MetricsReporter(
                config.report_to, run_id=self.run_id, store=self.store,
                log_dir=tensorboard_dir(config.output_dir, config.run_name) if "tensorboard" in config.report_to
                else None, run_name=config.run_name or self.output_dir.name, config=redacted_config(config),
                tags=config.tags, is_main_process=self.is_main, progress=True,
                replayed_through=steps_logged(self.store, self.run_id) if previous else 0)
        except Exception as e:  # the run is open in the store: record why it ended, not leave it "running"
            if self.store is not None and self.run_id is not None:
                self.store.finish_run(self.run_id, "failed", error=e)
            raise
        self.reporter.start(config.max_steps, description=kind, completed=self.start_step)

    # ------------------------------------------------------------------ bookkeeping

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def record_trajectories(self, trajectories: Iterable[Trajectory], step: int) -> None:
        """Every rollout lands in the store as a child run of this training run (one transaction)."""
        if self.store is None or self.run_id is None:
            return
        trajs = list(trajectories)
        bulk = getattr(self.store, "record_trajectories", None)
        if bulk is not None:
            bulk(trajs, kind="rollout", parent_id=self.run_id, tags=[f"step:{step}"])
        else:
            for t in trajs:
                self.store.record_trajectory(t, kind="rollout", parent_id=self.run_id, tags=[f"step:{step}"])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.step = step
        if step % self.config.logging_steps == 0 or step == self.config.max_steps:
            self.reporter.log(step, metrics)
        self.reporter.advance(step)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def clip_gradients(self, step: int | None = None, loss: float = 0.0) -> float:
        """Clip the gradients (``max_grad_norm``) and return their norm. With ``step``, a NaN or
        infinite norm or ``loss`` stops the run before the optimizer applies the step
        (:class:`~closedloop.trainers.common.TrainingDivergedError`)."""
        max_norm = self.config.max_grad_norm
        params = [p for p in self.model.parameters() if p.requires_grad]
        if max_norm is None or max_norm <= 0:
            norms = [p.grad.detach().norm() for p in params if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
        else:
            norm = float(self.accelerator.clip_grad_norm_(params, max_norm))
        if step is not None:
            stop_if_diverged(step, self.accelerator, loss=loss, grad_norm=norm)
        return norm

    # ------------------------------------------------------------------ checkpoints

    def _resume(self) -> None:
        from closedloop.trainers import checkpoint as ckpt

        where = ckpt.resolve_resume(self.config.resume, self.output_dir)
        if where is None:
            return
        state = ckpt.load_checkpoint(where, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                     accelerator=self.accelerator)
        self.start_step = self.step = state.step
        self.resumed_state = state

    def save(self, step: int, *, interrupted: bool = False, metrics: dict[str, float] | None = None) -> Path:
        """A resumable checkpoint (every process must call it)."""
        from closedloop.trainers import checkpoint as ckpt

        state = ckpt.TrainerState(step=step, run_id=self.run_id, trainer=self.kind, metrics=dict(metrics or {}),
                                  extra={"interrupted": interrupted})
        return ckpt.save_checkpoint(self.output_dir, state, model=self.model, tokenizer=self.tokenizer,
                                    optimizer=self.optimizer, scheduler=self.scheduler, accelerator=self.accelerator,
                                    save_total_limit=self.config.save_total_limit, config=self.config)

    def maybe_save(self, step: int) -> None:
        if self.config.save_steps and step % self.config.save_steps == 0:
            self.save(step)

    def save_final(self) -> Path:
        """A last resumable checkpoint, and the final model as a plain HF directory in
        ``output_dir`` itself (as SFT does) that ``hf:`` and ``closedloop serve`` load."""
        from closedloop.trainers import checkpoint as ckpt

        self.save(self.step)
        ckpt.save_final_model(self.model, self.tokenizer, self.output_dir, accelerator=self.accelerator)
        return self.output_dir

    def finish(self, status: str = "completed", error: BaseException | None = None) -> None:
        """Close the sinks and the store run, with ``error`` (what stopped a failed run) recorded.
        Only the first call counts (a failure while finishing is not recorded over the outcome)."""
        if self._finished:
            return
        self._finished = True
        self.reporter.close()
        if self.store is not None and self.run_id is not None:
            last = self.reporter.history[-1][1] if self.reporter.history else {}
            self.store.finish_run(self.run_id, status, outcome={"steps": self.step, "final_metrics": last,
                                                                "output_dir": str(self.output_dir)}, error=error)


__all__ = ["TrainingSession"]
