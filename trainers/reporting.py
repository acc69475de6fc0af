"""Where a trainer's metrics go: the run store, TensorBoard, trackio, W&B, and the terminal.

Like TRL's ``report_to``, the sinks are chosen by name; each optional backend is imported only when
asked for, with an error that says how to install it (a training run that silently logs nowhere is
worse than one that refuses to start). Under DDP only the main process reports, so every sink sees
each step once. The terminal gets a live progress bar with the latest metrics on it, a log file a
line per step (:class:`closedloop.terminal.JobProgress`).
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

from closedloop.terminal import JobProgress, format_metrics, quiet_third_party

__all__ = ["MetricsReporter", "ReporterError", "format_metrics"]


class ReporterError(RuntimeError):
    """A requested metrics sink cannot be used (package missing, store unusable)."""


def _scalar(value: Any) -> float | None:
    """A plain float from a number or 0-d tensor/array; None for what is not a finite-or-nan scalar."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


class MetricsReporter:
    """Fan one ``{name: scalar}`` dict per step out to the chosen sinks.

    ``report_to``: names from :data:`closedloop.trainers.config.REPORT_TO_CHOICES` (``"store"``,
    ``"tensorboard"``, ``"trackio"``, ``"wandb"``); ``"none"`` or ``[]`` for none.
    ``store``: a :class:`~closedloop.store.RunStore` (or its path) for ``"store"``, with ``run_id``
    the run the metrics belong to. ``log_dir``: TensorBoard's event directory.
    ``is_main_process``: False on DDP ranks other than 0, which then report nothing.
    ``progress``: show a rich progress bar (call :meth:`start` with the total steps).
    ``replayed_through``: a resumed run's steps up to this one were already reported by the attempt
    that was stopped (it logged past its last checkpoint); when they are trained again they go to
    :attr:`history` and the terminal but not to the sinks, which hold each step once.

    The store sink calls ``RunStore.log_metrics(run_id, step, metrics)``. Until the store provides
    that method, metrics for the store are kept in :attr:`history` only and a warning says so.
    """

    def __init__(self, report_to: Iterable[str] | str | None = ("store",), run_id: str | None = None,
                 store: Any = None, log_dir: str | os.PathLike[str] | None = None, *, run_name: str | None = None,
                 config: Mapping[str, Any] | None = None, tags: Iterable[str] = (), project: str | None = None,
                 is_main_process: bool = True, progress: bool = True, console: Any = None,
                 replayed_through: int = 0) -> None:
        if report_to is None or report_to == "none":
            names: list[str] = []
        elif isinstance(report_to, str):
            names = [report_to]
        else:
            names = [n for n in report_to if n != "none"]
        from closedloop.trainers.config import REPORT_TO_CHOICES

        bad = [n for n in names if n not in REPORT_TO_CHOICES]
        if bad:
            raise ReporterError(f"unknown report_to sink(s) {bad}; choose from {list(REPORT_TO_CHOICES)} or 'none'")
        self.report_to = names
        self.run_id = run_id
        self.run_name = run_name
        self.is_main_process = is_main_process
        self.replayed_through = replayed_through
        #: Every ``(step, metrics)`` logged, in order (kept on every process; cheap and handy for results).
        self.history: list[tuple[int, dict[str, float]]] = []
        self._store = None
        self._tb = None
        self._wandb = None
        self._trackio = None
        self._progress: Any = None  # a rich Progress once started
        self._task: Any = None
        self._show_progress = progress
        self._console = console
        self._closed = False
        self._started = time.perf_counter()
        if not is_main_process:
            return
        project = project or os.environ.get("WANDB_PROJECT") or os.environ.get("TRACKIO_PROJECT") or "closedloop"
        cfg = dict(config or {})
        if "store" in names:
            self._store = self._open_store(store, run_id)
        if "tensorboard" in names:
            self._tb = self._open_tensorboard(log_dir, cfg)
        if "wandb" in names:
            try:
                import wandb
            except ImportError as e:
                raise ReporterError("report_to includes 'wandb' but wandb is not installed: pip install wandb") from e
            self._wandb = wandb.init(project=project, name=run_name, config=cfg, tags=list(tags) or None,
                                     reinit=True)
        if "trackio" in names:
            try:
                import trackio
            except ImportError as e:
                raise ReporterError("report_to includes 'trackio' but trackio is not installed: pip install trackio") from e
            self._trackio = trackio
            trackio.init(project=project, name=run_name, config=cfg)

    # ------------------------------------------------------------------ sinks

    @staticmethod
    def _open_store(store: Any, run_id: str | None) -> Any:
        if store is None or run_id is None:
            raise ReporterError("report_to includes 'store' but no run store and run id were given")
        if isinstance(store, (str, os.PathLike)):
            from closedloop.store import RunStore

            store = RunStore(store)
        if not hasattr(store, "log_metrics"):
            warnings.warn("this RunStore has no log_metrics(run_id, step, metrics) yet; metrics for the 'store' sink "
                          "are kept in memory (MetricsReporter.history) only", RuntimeWarning, stacklevel=3)
        return store

    @staticmethod
    def _open_tensorboard(log_dir: Any, cfg: Mapping[str, Any]) -> Any:
        if log_dir is None:
            raise ReporterError("report_to includes 'tensorboard' but no log_dir was given")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch raises ImportError naming tensorboard when it is absent
            raise ReporterError("report_to includes 'tensorboard' but the tensorboard package is not installed: "
                                "pip install 'closedloop[tensorboard]'") from e
        writer = SummaryWriter(log_dir=str(log_dir))
        if cfg:
            import json

            writer.add_text("config", "```\n" + json.dumps(cfg, indent=2, default=str) + "\n```")
        return writer

    # ------------------------------------------------------------------ progress

    def start(self, total_steps: int | None, description: str = "train", completed: int = 0) -> None:
        """Show the progress of ``total_steps`` optimizer steps (``completed`` already done on
        resume): a live bar on a terminal, a line per step in a log (:class:`closedloop.terminal.JobProgress`)."""
        if not (self.is_main_process and self._show_progress) or self._progress is not None:
            return
        quiet_third_party()  # transformers' "Writing model shards" bars would cut through ours
        self._progress = JobProgress(description, total_steps, done=completed, unit="steps",
                                     console=self._console).__enter__()

    def advance(self, step: int) -> None:
        """``step`` optimizer steps done (a log gets a line with the latest loss or reward)."""
        if self._progress is not None:
            self._progress.update(step)

    def print(self, text: str) -> None:
        """A line above the progress bar (main process only)."""
        if not self.is_main_process:
            return
        if self._progress is not None:
            self._progress.note(text)
        elif self._show_progress:
            print(text, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ logging

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Report ``metrics`` (scalars; tensors are converted, other values dropped) at ``step``.
        Returns the scalars that were logged."""
        clean = {k: v for k, v in ((str(k), _scalar(v)) for k, v in metrics.items()) if v is not None}
        self.history.append((int(step), clean))
        if not self.is_main_process or self._closed:
            return clean
        if int(step) > self.replayed_through:
            self._to_sinks(int(step), clean)
        if self._progress is not None:
            self._progress.set_metrics(**{k: clean[k] for k in ("loss", "reward") if k in clean})
            self._progress.note(f"step {step}: {format_metrics(clean)}")
        return clean

    def _to_sinks(self, step: int, clean: dict[str, float]) -> None:
        if self._store is not None and hasattr(self._store, "log_metrics"):
            self._store.log_metrics(self.run_id, int(step), {k: v for k, v in clean.items() if math.isfinite(v)})
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, int(step))
        if self._wandb is not None:
            self._wandb.log(clean, step=int(step))
        if self._trackio is not None:
            self._trackio.log(clean, step=int(step))

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._trackio is not None:
            self._trackio.finish()

    def __enter__(self) -> "MetricsReporter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self._started


def tensorboard_dir(output_dir: str | os.PathLike[str], run_name: str | None = None) -> Path:
    """The default TensorBoard directory of a run: ``<output_dir>/runs/<run_name>``."""
    return Path(output_dir) / "runs" / (run_name or "train")
