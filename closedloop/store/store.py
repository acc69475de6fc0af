"""Every run of an agent graph (interactive, evaluation episode, training rollout) in one DuckDB file.

:class:`RunStore` is the store's public face: each method says which transaction it runs, and the
modules beside it say what happens inside:

- :mod:`~closedloop.store.connection`: the file, its lock and the one transaction helper. The
  store holds the file between operations only while its background writer streams batches, and
  lets it go as soon as another process (``closedloop runs list`` next to a running eval) waits
  for it, so that process gets its turn between batches; a crash mid-write loses only the
  uncommitted transaction.
- :mod:`~closedloop.store.runs`: start, finish, reopen, and runs whose process died marked
  ``killed`` ("on open", and before any read shows them).
- three ways to write, by cost (opening the file costs tens of milliseconds):

  - synchronous (:mod:`~closedloop.store.writes`: ``log_messages``, ``log_turn``,
    ``log_tool_call``, ``log_metrics``): one transaction per call, committed when it returns.
    Simple, and what scripts and tests use; too slow to call per step from an event loop.
  - queued (:mod:`~closedloop.store.queued`: ``log_step``, used by
    :class:`~closedloop.runtime.recording.StoreRecorder`): appended in microseconds and committed
    by a background thread, one transaction per batch. Durability: what :meth:`RunStore.flush`
    returned from is committed (``finish_run``, ``close``, any synchronous call on the same store
    and interpreter exit flush first, so a finished run is complete). Before that, a SIGKILL
    loses the steps queued since the last commit. ``flush_interval_s`` is only the shortest
    gathering (after an expensive batch the writer gathers longer, up to a second, to keep its
    share of a core small); the commit then takes the CPU time of preparing and writing the batch
    (stretched many times on a loaded machine) plus any wait for another process's lock, so no
    wall-clock bound holds. What is bounded is the count: at most ``max_queued_steps`` waiting
    plus one batch being written. See :mod:`closedloop.store.writer`.
  - bulk (:mod:`~closedloop.store.bulk`: ``record_trajectory``, ``record_trajectories``):
    finished episodes with their run rows in one transaction, one vectorised insert per table
    (:mod:`closedloop.store.batch`). A finished episode is either all there or not at all.

- reads: :mod:`~closedloop.store.reads` (``list_runs``, ``get_run``, ``metrics``; one run filter)
  and :mod:`~closedloop.store.trajectories` (``iter_trajectories``: one connection per
  ``batch_size`` runs, never one file open per run).
- :mod:`~closedloop.store.parquet` (``export_parquet``), :mod:`~closedloop.store.retention`
  (``delete_older_than``), :mod:`~closedloop.store.media` (images and audio by content address);
  the tables and their migrations: :mod:`~closedloop.store.schema`.

Where a store may live (``path``, ``create_dirs``): :mod:`closedloop.store.location`. What never
reaches the file: credentials (:mod:`closedloop.redact`), including the token ids of text they
were redacted from (:func:`closedloop.store.batch.without_token_ids`).

Why a façade over modules of functions, not mixins: each concern module's dependencies are its
parameters (a connection, a price function), so it reads and type-checks alone, and this class
shows the whole API in one file; mixins would spread one class over the modules, calling each
other through ``self`` (a finish flushes the queue, a read reaps dead runs) where no one file shows it.
"""

from __future__ import annotations

import asyncio
import math
import os
import warnings
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping, Sequence, TypeVar

import duckdb

from closedloop.messages import ToolCall, Trajectory, Turn, _Message, parse_messages
from closedloop.redact import env_secrets, redact
import closedloop.store.bulk as bulk
import closedloop.store.parquet as parquet
import closedloop.store.queued as queued
import closedloop.store.reads as reads
import closedloop.store.retention as retention
import closedloop.store.runs as runs
import closedloop.store.trajectories as trajectories
import closedloop.store.writes as writes
from closedloop.store.batch import gc_paused, prepare_message, prepare_turn
from closedloop.store.connection import StoreFile, lock_timeout_from_env
from closedloop.store.errors import RunNotFoundError, RunStateError, StoreBusyError, StoreOpenError
from closedloop.store.media import MediaMode, MediaSink, fetch_media
from closedloop.store.pricing import PriceFn, cost_usd
from closedloop.store.records import TERMINAL_STATUSES, RunRecord, RunSummary, utcnow
from closedloop.store.schema import migrate, target_version, version_on_file
from closedloop.store.values import jsonable
from closedloop.tool import ToolResult

__all__ = ["RunStore", "ActiveRun", "RunNotFoundError", "RunStateError", "StoreBusyError", "StoreOpenError"]

T = TypeVar("T")


class RunStore:
    """Runs, messages, turns and tool calls in one DuckDB file (or ``":memory:"`` for tests).

    ``price_fn(model, prompt_tokens, completion_tokens) -> usd | None`` prices turns whose usage
    has no cost; the default uses :mod:`closedloop.store.pricing`. ``flush_interval_s``: how long
    the background writer gathers queued writes (:meth:`log_step`) at least before it commits them
    (up to a second after an expensive batch; not a bound on when they are durable: :meth:`flush`
    is, see the module docstring);
    ``max_queued_steps``: how many may wait at most. ``create_dirs``: create a missing directory
    of ``path`` (the default location's always is), see :mod:`closedloop.store.location`.
    ``lock_timeout_s``: how long to wait for another process's lock (default
    ``$CLOSEDLOOP_STORE_LOCK_TIMEOUT``, else 15 s). ``detect_killed``: mark this host's runs whose
    process is gone ``killed``.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, lock_timeout_s: float | None = None,
                 price_fn: PriceFn | None = None, detect_killed: bool = True,
                 flush_interval_s: float = 0.1, max_queued_steps: int = 1024, create_dirs: bool = False) -> None:
        if lock_timeout_s is None:
            lock_timeout_s = lock_timeout_from_env()
        if not lock_timeout_s >= 0:
            raise ValueError("lock_timeout_s must be >= 0")
        if not (flush_interval_s >= 0 and math.isfinite(flush_interval_s)):
            raise ValueError("flush_interval_s must be a finite number >= 0")
        if isinstance(max_queued_steps, bool) or not isinstance(max_queued_steps, int) or max_queued_steps < 1:
            raise ValueError("max_queued_steps must be an int >= 1")
        self.price_fn: PriceFn = price_fn or cost_usd
        self.detect_killed = detect_killed
        self.flush_interval_s = flush_interval_s
        self.max_queued_steps = max_queued_steps
        self._file = StoreFile(path, lock_timeout_s=lock_timeout_s, create_dirs=create_dirs)
        self._queue = queued.StepQueue(label=str(self._file.path), interval_s=flush_interval_s,
                                       max_pending=max_queued_steps, holder=self._file)
        self._open()

    @property
    def path(self) -> Path | str:
        """The DuckDB file (``":memory:"`` for an in-memory store)."""
        return self._file.path

    @property
    def lock_timeout_s(self) -> float:
        return self._file.lock_timeout_s

    @lock_timeout_s.setter
    def lock_timeout_s(self, value: float) -> None:
        self._file.lock_timeout_s = value

    def __repr__(self) -> str:
        return f"RunStore({str(self.path)!r})"

    def _open(self) -> None:
        """Bring the file up to date and mark dead writers' runs killed ("on open"). A file already
        at this version with no dead run needs only the shared lock, so opening a store to read it
        (``closedloop runs show`` beside a training job) never waits for the writer's lock."""
        try:
            if isinstance(self.path, Path) and self.path.exists() and self._tx(self._up_to_date, read_only=True):
                return
            self._tx(self._reap, before=migrate)
        except duckdb.IOException as e:  # after check_store_path: a damaged file, a full or read-only disk
            raise StoreOpenError(f"run store {self.path} cannot be opened: {str(e).splitlines()[0]}") from None

    def _up_to_date(self, con: duckdb.DuckDBPyConnection) -> bool:
        return version_on_file(con) == target_version() and not runs.dead_runs(con, detect_killed=self.detect_killed)

    def _reap(self, con: duckdb.DuckDBPyConnection) -> list[str]:
        return runs.reap(con, detect_killed=self.detect_killed)

    # ------------------------------------------------------------------ transactions

    def _tx(self, fn: Callable[[duckdb.DuckDBPyConnection], T],
            before: Callable[[duckdb.DuckDBPyConnection], Any] | None = None, *, read_only: bool = False) -> T:
        """``fn`` in one transaction (:meth:`closedloop.store.connection.StoreFile.transaction`)."""
        return self._file.transaction(fn, before, read_only=read_only)

    def _connect(self, deadline: float | None = None, *,
                 read_only: bool = False) -> AbstractContextManager[duckdb.DuckDBPyConnection]:
        """A connection under the store's lock, outside any transaction (tests look at the file this way)."""
        return self._file.connect(deadline, read_only=read_only)

    def read(self, fn: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
        """``fn`` (which only reads) under the shared lock on a read-only connection, the file released
        as soon as it returns: the public way for viewers and tools to run their own queries without
        disturbing a writer in another process. Runs whose writer died are marked
        ``killed`` first (that is a write: it takes the exclusive lock, and only when there are
        such runs), so a read never shows a dead run as running."""
        def read(con: duckdb.DuckDBPyConnection) -> tuple[bool, T | None]:
            if runs.dead_runs(con, detect_killed=self.detect_killed):
                return True, None
            return False, fn(con)

        for _ in range(3):
            dead, result = self._tx(read, read_only=True)
            if not dead:
                return result  # type: ignore[return-value]  # fn's own result, None only if fn returned None
            self._tx(self._reap)
        return self._tx(fn, read_only=True)  # runs keep dying as we look: show them as they are

    # ------------------------------------------------------------------ runs

    def start_run(self, *, kind: str = "run", graph: str | None = None, model_spec: str | None = None,
                  config: Any = None, tags: Sequence[str] | None = None, metadata: Mapping[str, Any] | None = None,
                  parent_id: str | None = None, run_id: str | None = None) -> str:
        """Open a run owned by this process; returns its id."""
        new = runs.new_run(kind=kind, graph=graph, model_spec=model_spec, config=config, tags=tags,
                           metadata=metadata, parent_id=parent_id, run_id=run_id)
        self._tx(lambda con: runs.insert_run(con, new))
        return new.id

    def finish_run(self, run_id: str, status: str = "completed", outcome: Mapping[str, Any] | None = None,
                   error: BaseException | str | None = None) -> None:
        """Close a running run with a terminal status, its outcome (answer, rewards) and error."""
        out, err = runs.finish_values(status, outcome, error)
        self._queue.flush_pending()  # everything the run queued lands before it is marked finished
        self._tx(lambda con: runs.write_finish(con, run_id, status, out, err))

    def run(self, **start_kwargs: Any) -> "ActiveRun":
        """``with store.run(graph=...) as run:`` completed on exit, failed on exception,
        interrupted on KeyboardInterrupt/CancelledError. Also ``async with``."""
        return ActiveRun(self, start_kwargs)

    def reopen_run(self, run_id: str, config: Any = None) -> None:
        """Make a finished run ``running`` again, owned by this process (resuming a long job such as an
        evaluation under the same id). Refuses a run that is still running: two writers would
        duplicate work. Its metadata counts the attempts and keeps the earlier statuses."""
        cfg = redact(jsonable(config), env_secrets=env_secrets()) if config is not None else None
        self._tx(lambda con: runs.reopen(con, run_id, cfg, detect_killed=self.detect_killed))

    def reap_killed(self) -> list[str]:
        """Mark ``killed`` the running runs of this host whose process is gone; returns their ids.

        Their ``ended_at`` is the last write we saw, the closest we know to when they died.
        """
        return self._tx(self._reap)

    # ------------------------------------------------------------------ synchronous writes

    def log_messages(self, run_id: str, messages: Sequence[_Message | dict[str, Any]], *, replace: bool = False) -> int:
        """Append messages (or, with ``replace``, rewrite the run's message list); returns the count."""
        typed = parse_messages(list(messages))
        secrets = env_secrets()
        sink = MediaSink()
        rows = [prepare_message(m, secrets, sink) for m in typed]
        self._queue.flush_pending()
        return self._tx(lambda con: writes.write_messages(con, run_id, rows, replace, sink))

    def log_turn(self, run_id: str, turn: Turn) -> int:
        """Record one model call token-exactly; adds its usage and cost to the run. Returns its index."""
        if not isinstance(turn, Turn):
            raise TypeError(f"log_turn takes a closedloop.messages.Turn, got {type(turn).__name__}")
        sink = MediaSink()
        prepared = prepare_turn(turn, env_secrets(), media=sink)
        self._queue.flush_pending()
        return self._tx(lambda con: writes.write_turn(con, run_id, prepared, self.price_fn, sink))

    def log_tool_call(self, run_id: str, call: ToolCall, result: ToolResult, turn_idx: int | None = None) -> int:
        """Record a tool call and what it returned; ``turn_idx`` defaults to the latest turn."""
        prepared = writes.prepare_call(call, result, env_secrets())
        self._queue.flush_pending()
        return self._tx(lambda con: writes.write_tool_call(con, run_id, prepared, turn_idx))

    def log_metrics(self, run_id: str, step: int | Iterable[tuple[int, Mapping[str, float]]],
                    metrics: Mapping[str, float] | None = None, *, wait: bool = True) -> int:
        """Record named scalar metrics of a training step: ``log_metrics(id, 3, {"loss": 0.4, "kl": 0.01})``,
        or many steps at once: ``log_metrics(id, [(3, {...}), (4, {...})])`` (one transaction).

        ``wait=False`` queues them like :meth:`log_step` instead of committing before returning.
        Returns the number of values recorded. Logging a name again for a step replaces its value
        (the table keeps one row per run, step and name): a resumed trainer that replays steps
        leaves no duplicates, in the table or in an export.
        """
        if metrics is not None:
            entries = writes.metric_entries([(step, metrics)])
        elif isinstance(step, int):
            raise TypeError("log_metrics(run_id, step, metrics): metrics is missing")
        else:
            entries = writes.metric_entries(step)
        if not wait:
            self._queue.submit(queued.Step(run_id, [], [], [], entries, False), self._write_steps)
            return len(entries)
        self._queue.flush_pending()
        return self._tx(lambda con: writes.write_metrics(con, run_id, entries))

    # ------------------------------------------------------------------ queued writes

    def log_step(self, run_id: str, messages: Sequence[_Message | dict[str, Any]] = (), turns: Sequence[Turn] = (),
                 tool_calls: Sequence[tuple[ToolCall, ToolResult, int | None]] = (), *, replace: bool = False) -> None:
        """Queue what one graph step added; returns at once (microseconds), never touching the file.

        A background thread commits queued steps in order, one transaction per batch (gathered for
        ``flush_interval_s`` or longer, see :mod:`closedloop.store.writer`). The objects are serialised on that thread: do not mutate them after
        the call. Errors (the run is not running, a store problem) cannot be raised here; they are
        warned about and raised by the next :meth:`flush`. ``tool_calls`` are ``(call, result,
        turn_idx)``; ``turn_idx=None`` means the run's latest turn at that point.
        """
        typed: list[_Message] = [m for m in messages if isinstance(m, _Message)]
        if len(typed) != len(messages):
            typed = parse_messages(list(messages))
        for t in turns:
            if not isinstance(t, Turn):
                raise TypeError(f"log_step takes closedloop.messages.Turn objects, got {type(t).__name__}")
        if typed or turns or tool_calls or replace:
            self._queue.submit(queued.Step(run_id, typed, list(turns), list(tool_calls), [], replace),
                               self._write_steps)

    def flush(self) -> None:
        """Commit every queued write now; then raise the first queued write that failed since the
        last ``flush`` (a :class:`RunStateError` for a step logged to a finished run, say).

        The ack point of the queued path: when it returns, every step logged before it survives a
        SIGKILL of this process."""
        self._queue.flush_pending()
        errors = self._queue.errors
        if errors:
            self._queue.errors = []
            more = f" ({len(errors) - 1} more queued write(s) failed too)" if len(errors) > 1 else ""
            raise type(errors[0])(f"{errors[0]}{more}") from errors[0]

    def _write_steps(self, steps: list[queued.Step]) -> None:
        """The background writer's batch (the store's current ``price_fn`` prices its turns)."""
        queued.write_steps(self._tx, steps, self.price_fn, self._queue.report_dropped)

    # ------------------------------------------------------------------ bulk writes

    def record_trajectory(self, trajectory: Trajectory, *, kind: str = "train", status: str = "completed",
                          graph: str | None = None, model_spec: str | None = None, config: Any = None,
                          tags: Sequence[str] | None = None, outcome: Mapping[str, Any] | None = None,
                          parent_id: str | None = None, started_at: datetime | None = None,
                          error: str | None = None) -> str:
        """Store a finished trajectory as one run (id = trajectory id) in a single transaction.

        One connection for the whole episode instead of one per turn: the cheap path for trainers
        that log hundreds of rollouts, and for evaluations that must never leave half an episode.
        ``started_at`` (naive UTC) records when the episode really began, so durations are real.
        The run's outcome is ``{"rewards": trajectory.rewards, "step_rewards": ..., **outcome}``.
        """
        episode = bulk.Episode(trajectory, outcome, started_at, error)
        return self._record(bulk.RunDefaults(kind, status, graph, model_spec, config, tags, parent_id), [episode])[0]

    def record_trajectories(self, trajectories: Sequence[Trajectory], *, kind: str = "train",
                            status: str = "completed", graph: str | None = None, model_spec: str | None = None,
                            config: Any = None, tags: Sequence[str] | None = None, parent_id: str | None = None,
                            outcomes: Sequence[Mapping[str, Any] | None] | None = None) -> list[str]:
        """Store many finished trajectories (one run each, ids = trajectory ids) in ONE transaction.

        All or nothing: if any id already exists, nothing is written. Run rows, messages and turns
        go in with one vectorised insert per table, so a rollout batch of thousands of turns costs
        one file open and a few statements. ``outcomes[i]`` is merged into trajectory ``i``'s outcome.
        """
        trajectories = list(trajectories)
        if outcomes is not None and len(outcomes) != len(trajectories):
            raise ValueError(f"outcomes has {len(outcomes)} entries for {len(trajectories)} trajectories")
        episodes = [bulk.Episode(t, outcomes[i] if outcomes is not None else None)
                    for i, t in enumerate(trajectories)]
        return self._record(bulk.RunDefaults(kind, status, graph, model_spec, config, tags, parent_id), episodes)

    def _record(self, defaults: bulk.RunDefaults, episodes: list[bulk.Episode]) -> list[str]:
        ids = bulk.check_batch(defaults, episodes)
        if not ids:
            return []
        with gc_paused():
            batch = bulk.prepare_batch(defaults, episodes, ids, self.price_fn)
            return self._tx(batch.write, before=bulk.bulk_settings if self._file.memory is None else None)

    # ------------------------------------------------------------------ reads

    def get_run(self, run_id: str, *, media: MediaMode = "inline") -> RunRecord:
        """The run with its messages, turns and tool calls; accepts a unique id prefix.

        ``media="inline"`` (default) gives image/audio parts back exactly as recorded;
        ``"refs"`` leaves them as ``closedloop-media:sha256:...`` references without reading the
        bytes (see :meth:`media_bytes`)."""
        reads.check_media_mode(media)
        self._queue.flush_pending()
        return self.read(lambda con: reads.read_run(con, run_id, media))

    def load_trajectory(self, run_id: str, *, media: MediaMode = "inline") -> Trajectory:
        """The run as a trainer sees it (see :meth:`RunRecord.to_trajectory`); ``media`` as in :meth:`get_run`."""
        return self.get_run(run_id, media=media).to_trajectory()

    def metrics(self, run_id: str) -> list[dict[str, Any]]:
        """Per-step metrics of a run, oldest step first: ``[{"step": 0, "loss": ..., ...}, ...]``."""
        self._queue.flush_pending()
        return self._tx(lambda con: reads.read_metrics(con, run_id), read_only=True)

    def media_bytes(self, sha256: str) -> bytes:
        """The bytes of one stored image/audio (by the hash a reference or ``MediaRef`` names)."""
        digest = sha256.removeprefix("sha256:")
        self._queue.flush_pending()
        found = self._tx(lambda con: fetch_media(con, [digest]), read_only=True)
        if digest not in found:
            raise KeyError(f"no media sha256:{digest} in {self.path}")
        return found[digest]

    def list_runs(self, limit: int | None = 50, status: str | None = None, graph: str | None = None,
                  kind: str | None = None, parent_id: str | None = None, tag: str | None = None,
                  model_spec: str | None = None) -> list[RunSummary]:
        """Newest first; the filters as in :meth:`iter_trajectories`."""
        if limit is not None and limit < 0:
            raise ValueError("limit must be >= 0")
        where, params = reads.run_filter(status=status, graph=graph, kind=kind, parent_id=parent_id,
                                         model_spec=model_spec, tag=tag)
        clause = where + " ORDER BY started_at DESC, id" + (f" LIMIT {int(limit)}" if limit is not None else "")
        self._queue.flush_pending()
        return self.read(lambda con: reads.summaries(con, clause, params))

    def resolve_id(self, prefix: str) -> str:
        return self._tx(lambda con: reads.resolve(con, prefix), read_only=True)

    def iter_trajectories(self, *, kind: str | None = None, graph: str | None = None, tag: str | None = None,
                          metadata: Mapping[str, Any] | None = None, status: str | None = None,
                          min_reward: float | None = None, parent_id: str | None = None,
                          model_spec: str | None = None, limit: int | None = None,
                          batch_size: int = 256, media: MediaMode = "inline") -> Iterator[Trajectory]:
        """Trajectories of every matching run, oldest first, read in batches.

        One query selects the runs (filters on the run row; ``metadata`` keeps runs whose metadata
        has all of these key/value pairs; ``min_reward`` keeps runs whose summed outcome rewards are
        at least that, runs without rewards never). Then each batch of ``batch_size`` runs costs one
        connection (the first batch shares the selecting one) and two queries (messages, turns),
        released before the batch is decoded and yielded, so a slow consumer never holds the file.
        Each trajectory equals ``load_trajectory(id)``: rewards and step rewards from the run's
        outcome, ``metadata`` with ``run_id``, ``kind``, ``graph``, ``parent_id``, ... and
        ``task_id`` (see :func:`closedloop.store.records.trajectory_metadata`). ``media``: as in
        :meth:`get_run` (``"refs"`` reads no media bytes: large exports).
        """
        reads.check_media_mode(media)
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if limit is not None and limit < 0:
            raise ValueError("limit must be >= 0")
        if status is not None and status not in ("running",) + TERMINAL_STATUSES:
            raise ValueError(f"status must be one of {('running',) + TERMINAL_STATUSES}, got {status!r}")
        where, params = reads.run_filter(status=status, graph=graph, kind=kind, parent_id=parent_id,
                                         model_spec=model_spec, tag=tag)
        want = dict(jsonable(metadata) or {})
        self._queue.flush_pending()

        def select_and_first(con: duckdb.DuckDBPyConnection) -> tuple[list[trajectories.Selected],
                                                                      trajectories.Batch]:
            selected = trajectories.select_runs(con, where, params, metadata=want, min_reward=min_reward,
                                                limit=limit)
            return selected, trajectories.read_batch(con, [s.run_id for s in selected[:batch_size]], media)

        selected, batch = self.read(select_and_first)
        for start in range(0, len(selected), batch_size):
            chunk = selected[start:start + batch_size]
            if start > 0:
                ids = [s.run_id for s in chunk]
                batch = self._tx(lambda con: trajectories.read_batch(con, ids, media), read_only=True)
            out = trajectories.decode_batch(chunk, batch)  # after the file is released
            del batch
            yield from out

    # ------------------------------------------------------------------ export, retention

    def export_parquet(self, directory: str | os.PathLike[str], *, media: MediaMode = "inline") -> dict[str, Path]:
        """One Parquet file per table, written by DuckDB from one consistent snapshot.

        ``media="inline"``: message JSON (``messages.json``, ``turns.message``) holds image/audio
        parts as recorded (base64), so each file stands alone; ``"refs"``: it keeps the stored
        references and ``media.parquet`` (sha256, mime, size, data) holds each blob once."""
        reads.check_media_mode(media)
        self._queue.flush_pending()
        out = Path(directory).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        paths = parquet.parquet_paths(out, media)
        return self.read(lambda con: parquet.write_parquet(con, paths, media))

    def delete_older_than(self, age: timedelta) -> int:
        """Delete finished runs that ended more than ``age`` ago, with their child rows; returns how many.

        Running runs are never deleted, however old: a long training job is still writing to them.
        """
        if not isinstance(age, timedelta) or age < timedelta(0):
            raise ValueError("age must be a non-negative timedelta")
        cutoff = utcnow() - age
        self._queue.flush_pending()
        return self._tx(lambda con: retention.delete_finished_before(con, cutoff, detect_killed=self.detect_killed))

    def close(self) -> None:
        """Commit queued writes and stop the background writer (a later queued write restarts it)."""
        self._queue.close()
        self._file.close()


class ActiveRun:
    """A run opened by ``with store.run(...)``: logs to its run and closes it on exit."""

    def __init__(self, store: RunStore, start_kwargs: dict[str, Any]) -> None:
        self.store = store
        self._start_kwargs = start_kwargs
        self.id: str | None = None
        self.outcome: dict[str, Any] = {}
        self.finished = False

    def _run_id(self) -> str:
        if self.id is None:
            raise RunStateError("the run has not started; use it as `with store.run(...) as run:`")
        return self.id

    def log_messages(self, messages: Sequence[_Message | dict[str, Any]], *, replace: bool = False) -> int:
        return self.store.log_messages(self._run_id(), messages, replace=replace)

    def log_turn(self, turn: Turn) -> int:
        return self.store.log_turn(self._run_id(), turn)

    def log_tool_call(self, call: ToolCall, result: ToolResult, turn_idx: int | None = None) -> int:
        return self.store.log_tool_call(self._run_id(), call, result, turn_idx)

    def log_step(self, messages: Sequence[_Message | dict[str, Any]] = (), turns: Sequence[Turn] = (),
                 tool_calls: Sequence[tuple[ToolCall, ToolResult, int | None]] = ()) -> None:
        self.store.log_step(self._run_id(), messages, turns, tool_calls)

    def log_metrics(self, step: int | Iterable[tuple[int, Mapping[str, float]]],
                    metrics: Mapping[str, float] | None = None, *, wait: bool = True) -> int:
        return self.store.log_metrics(self._run_id(), step, metrics, wait=wait)

    def finish(self, status: str = "completed", outcome: Mapping[str, Any] | None = None,
               error: BaseException | str | None = None) -> None:
        self.store.finish_run(self._run_id(), status, {**self.outcome, **dict(outcome or {})}, error)
        self.finished = True

    def __enter__(self) -> "ActiveRun":
        self.id = self.store.start_run(**self._start_kwargs)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        if self.finished:
            return False
        if exc is None:
            self.finish("completed")
            return False
        status = "interrupted" if isinstance(exc, (KeyboardInterrupt, asyncio.CancelledError, SystemExit)) else "failed"
        try:
            self.finish(status, error=exc)
        except Exception as store_error:  # never hide the caller's exception behind a store problem
            warnings.warn(f"could not mark run {self.id} {status}: {store_error}", RuntimeWarning, stacklevel=2)
        return False

    async def __aenter__(self) -> "ActiveRun":
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: Any) -> Literal[False]:
        return self.__exit__(exc_type, exc, tb)
