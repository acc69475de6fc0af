"""What long jobs print: one live display on a terminal, one plain line per item in a log.

Evaluations, trainers and the tiny-model build run for minutes. On a terminal, rich's live
progress bar is the right display; written to a file (``> log``, CI, ``nohup``) the same bar is
drawn once, at the end, so the log stays empty for the whole job, and rich hard-wraps every line
at 80 columns, splitting ``key value`` pairs of metric lines. :class:`JobProgress` therefore
chooses by the stream: a live bar (progress, elapsed, ETA, the job's key metrics) when it is a
terminal, else one unwrapped line per step or episode, flushed as it happens, from the first one.
:func:`make_console` gives a console that never hard-wraps when not on a terminal.
:func:`quiet_third_party` turns off the progress bars of transformers, huggingface_hub and
datasets ("Loading weights", "Writing model shards"), whose carriage returns shred a log and whose
bars fight the live display on a terminal.
"""

from __future__ import annotations

import os
import sys
import time
from typing import IO, TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["JobProgress", "format_metrics", "is_terminal", "make_console", "quiet_third_party"]

# Wide enough for the summary tables in a log file; $COLUMNS (set by the user or a CI) wins.
_LOG_WIDTH = 200


def is_terminal(stream: IO[str] | None = None) -> bool:
    """Whether ``stream`` (stderr by default) is an interactive terminal."""
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed, or not a real file
        return False


def make_console(*, stderr: bool = False) -> Console:
    """A rich console for the stream: rich's own on a terminal; elsewhere one that never wraps text
    (a long line stays one line for grep and tail) and lays tables out in ``$COLUMNS`` or 200 columns."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if is_terminal(stream):
        return Console(stderr=stderr, highlight=False)
    width = int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS", "").isdigit() else _LOG_WIDTH
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


def quiet_third_party() -> None:
    """Switch off third-party progress bars for this process and its children, unless the user set
    the variables: our own progress says what is happening, once."""
    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(var, "1")
    for module in ("transformers.utils.logging", "datasets.utils.logging"):
        loaded = sys.modules.get(module)  # already imported: its switch was read at import time
        if loaded is not None and os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1":
            loaded.disable_progress_bar()


def format_metrics(metrics: Mapping[str, Any], keys: Iterable[str] | None = None) -> str:
    """``loss 0.4210 · lr 2.00e-05 · infra errors 0`` on one line (``keys``: which, in order; all by
    default). Learning rates and very small or large numbers in exponent form, integers as such."""
    parts = []
    for k in (keys if keys is not None else metrics):
        if k not in metrics:
            continue
        v = metrics[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            parts.append(f"{k} {v}")
        elif k in ("lr", "learning_rate") or (v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5)):
            parts.append(f"{k} {v:.2e}")
        elif float(v).is_integer() and abs(v) < 1e9:
            parts.append(f"{k} {int(v)}")
        else:
            parts.append(f"{k} {v:.4f}")
    return " · ".join(parts)


def _clock(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


class JobProgress:
    """One job's progress: ``title``, ``done`` of ``total``, elapsed, ETA and a few key metrics.

    On a terminal it is a rich live bar (transient lines from :meth:`note` print above it); in a
    log each :meth:`advance` prints one line, e.g.
    ``τ retail/train oracle  12/74 16%  elapsed 0:00:21  eta 0:01:49  avg reward 1.000 · infra 0``.
    Used as a context manager; ``total=None`` for jobs of unknown length (no ETA).
    """

    def __init__(self, title: str, total: int | None, *, done: int = 0, unit: str = "", every: int = 1,
                 console: Console | None = None, stream: IO[str] | None = None) -> None:
        self.title = title
        self.every = max(1, every)  # a log gets a line every this many items (and for the last one)
        self.total = total
        self.done = done
        self.unit = unit
        self.metrics: dict[str, Any] = {}
        self._stream = stream if stream is not None else sys.stderr
        self._live = is_terminal(self._stream)
        self._console = console
        self._start = time.monotonic()
        # The rate (hence the ETA) is measured from the first item done in this process: set-up time
        # before it (loading, tokenising) and items done before (a resumed job) are not in it. The
        # clock and the count start when that item is done, so its line has no ETA (as rich's bar).
        self._first: tuple[float, int] | None = None
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> JobProgress:
        if self._live:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            from rich.table import Column

            from rich.console import Console

            console = self._console or Console(file=self._stream, highlight=False)
            # On a narrow terminal the metrics give way (cut with an ellipsis), never the count or the ETA.
            self._progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(bar_width=20),
                                      MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"),
                                      TimeRemainingColumn(),
                                      TextColumn("{task.fields[metrics]}",
                                                 table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
                                      console=console, transient=False, expand=True)
            self._progress.start()
            self._task = self._progress.add_task(self.title, total=self.total, completed=self.done, metrics="")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def advance(self, n: int = 1, **metrics: Any) -> None:
        """``n`` more items done, with the latest key metrics (shown until replaced)."""
        self.update(self.done + n, **metrics)

    def update(self, done: int | None = None, **metrics: Any) -> None:
        """Set the count (and metrics); a log gets the progress line."""
        if done is not None:
            if self._first is None and done > self.done:
                self._first = (time.monotonic(), done)
            self.done = done
        self.metrics.update(metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, metrics=format_metrics(self.metrics))
        elif self.done % self.every == 0 or self.done == self.total:
            self._print(self.line())

    def set_metrics(self, **metrics: Any) -> None:
        """Replace shown metrics without counting an item (a log gets no line for this)."""
        self.metrics.update(metrics)
        if self._progress is not None:
            self._progress.update(self._task, metrics=format_metrics(self.metrics))

    def note(self, text: str) -> None:
        """A line of its own (a stage, a warning), above the live bar or in the log."""
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False, soft_wrap=True)
        else:
            self._print(text)

    def line(self) -> str:
        """The plain progress line (what a log gets for each item)."""
        elapsed = time.monotonic() - self._start
        count = f"{self.done}/{self.total}" if self.total else str(self.done)
        pct = f" {100 * self.done / self.total:.0f}%" if self.total else ""
        unit = f" {self.unit}" if self.unit else ""
        eta = ""
        if self.total and self._first is not None and self.done < self.total:
            since, before = self._first
            fresh = self.done - before
            if fresh > 0:
                eta = f"  eta {_clock((time.monotonic() - since) / fresh * (self.total - self.done))}"
        metrics = format_metrics(self.metrics)
        return f"{self.title}  {count}{unit}{pct}  elapsed {_clock(elapsed)}{eta}" + (f"  {metrics}" if metrics else "")

    def _print(self, text: str) -> None:
        try:
            print(text, file=self._stream, flush=True)
        except ValueError:  # the stream was closed under us (a test's capture): nothing to show
            pass
