"""Every run of an agent graph (interactive, evaluation episode, training rollout) in one DuckDB file.

DuckDB lets one process at a time open a file for writing, so the store never holds the file
between operations: each logical write opens a connection, runs inside BEGIN/COMMIT and closes.
Another process (``closedloop runs list`` next to a running eval) then gets its turn between
writes. Every open goes through the store's own lock first (:mod:`closedloop.store.lock`):
exclusive for a write, shared for a read (readers open the file ``read_only`` and may read
together); DuckDB 2 reads the file's header before it locks the file, and this lock is what keeps
another process from checkpointing in between. A lock held elsewhere is waited for, with
backoff, until ``lock_timeout_s`` (then :class:`StoreBusyError`, naming the holder). A crash
mid-write loses only the uncommitted transaction, never leaves half of one.

Opening the file costs tens of milliseconds, so there are three ways to write, by cost:

- synchronous (``log_messages``, ``log_turn``, ``log_tool_call``, ``log_metrics``): one
  connection and one transaction per call, committed when the call returns. Simple, and what
  scripts and tests use; too slow to call per step from an event loop.
- queued (``log_step``, used by :class:`~closedloop.runtime.recording.StoreRecorder`): appended
  to an in-process queue in microseconds and committed by a background thread, one transaction
  per batch. Durability: what :meth:`RunStore.flush` returned from is committed (``finish_run``,
  ``close``, any synchronous call on the same store and interpreter exit flush first, so a
  finished run is complete). Before that, a SIGKILL loses the steps queued since the last
  commit. ``flush_interval_s`` is only how long the writer gathers; the commit then takes the
  CPU time of preparing and writing the batch (stretched many times on a loaded machine: over a
  second at load 10) plus any wait for another process's lock, so no wall-clock bound holds.
  What is bounded is the count: at most ``max_queued_steps`` waiting plus one batch being written
  (a ``log_step`` beyond that waits for the writer). See :mod:`closedloop.store.writer`.
- bulk (``record_trajectory``, ``record_trajectories``): finished episodes, written with their
  run rows in one transaction, one vectorised insert per table (:mod:`closedloop.store.batch`).
  A finished episode is either all there or not there at all.

Reading many trajectories back (``iter_trajectories``) is one connection per ``batch_size`` runs
(the first also selects the runs), never one file open per run.

Where a store may live (``path``, ``create_dirs``): :mod:`closedloop.store.location`. What never
reaches the file: credentials (:mod:`closedloop.redact`), including the token ids of text they
were redacted from (:func:`closedloop.store.batch.without_token_ids`).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import math
import os
import random
import sys
import threading
import time
import traceback
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import duckdb
from pydantic import BaseModel, TypeAdapter

import closedloop
from closedloop.config import default_store_path
from closedloop.messages import (AssistantMessage, LogprobSpec, MediaRef, Message, ToolCall, Trajectory, Turn, Usage,
                                 _Message, parse_messages)
from closedloop.store import pricing
from closedloop.store.batch import (PreparedEpisode, PreparedToolCall, PreparedTurn, Pricer, Rows, gc_paused,
                                    prepare_episode, prepare_message, prepare_tool_call, prepare_turn, storable,
                                    turn_row, without_token_ids)
from closedloop.store.codec import decode_turn_arrays, turn_arrays_to_lists
from closedloop.store.media import (MediaMode, MediaSink, Restorer, collect_garbage, fetch_media, referenced_hashes,
                                    write_media)
from closedloop.store.process import hostname, pid_alive, process_start
from closedloop.store.records import (TERMINAL_STATUSES, RunRecord, RunSummary, ToolCallRecord, reward_dict,
                                      trajectory_metadata, utcnow)
from closedloop.redact import env_secrets as _env_secrets
from closedloop.redact import might_hold_secret, redact, redact_spec, redact_text
from closedloop.store.errors import (LOCK_TIMEOUT_ENV, RunNotFoundError, RunStateError, StoreBusyError,
                                     StoreOpenError)
from closedloop.store.lock import LockTimeout, StoreLock
from closedloop.store.location import check_store_path
from closedloop.store.schema import TABLES, TURN_COLUMNS, migrate, target_version, version_on_file
from closedloop.store.writer import BackgroundWriter, PartialBatch
from closedloop.tool import ToolResult

__all__ = ["RunStore", "ActiveRun", "RunNotFoundError", "RunStateError", "StoreBusyError", "StoreOpenError"]

T = TypeVar("T")
_MAX_ERROR_CHARS = 20_000
_DEFAULT_LOCK_TIMEOUT_S = 15.0


def _lock_timeout_from_env() -> float:
    raw = os.environ.get(LOCK_TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return _DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{LOCK_TIMEOUT_ENV}={raw!r}: give the seconds to wait for a locked run store (a number >= 0)")
    return value


def _jsonable(value: Any) -> Any:
    """Configs arrive as pydantic models, dataclasses or dicts; the store keeps plain JSON."""
    if value is None:
        return None
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, Mapping):
        value = dict(value)
    try:
        return json.loads(json.dumps(value, default=str))
    except (ValueError, RecursionError) as e:  # an int past Python's digit limit, nesting past the recursion limit
        raise ValueError(f"cannot store this value as JSON: {type(e).__name__}: {str(e)[:200]}") from None


def _redacted_json(value: Any, secrets: list[str], *, keys: bool = True, key_values: bool = True) -> str:
    """``_dumps(redact(_jsonable(value), ...))`` with one serialisation when the JSON text cannot
    hold anything to redact (:func:`~closedloop.store.redact.might_hold_secret`), the usual case."""
    if not isinstance(value, dict):
        value = _jsonable(value)
    text = storable(json.dumps(value, default=str, ensure_ascii=False))
    if not might_hold_secret(text, secrets):
        return text
    return _dumps(redact(json.loads(text), keys=keys, key_values=key_values, env_secrets=secrets)) or "null"


def _dumps(value: Any) -> str | None:
    return None if value is None else storable(json.dumps(value, ensure_ascii=False))


def _loads(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _format_error(error: BaseException | str | None) -> str | None:
    if error is None:
        return None
    if isinstance(error, BaseException):
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
        text = text or repr(error)
    else:
        text = str(error)
    return redact_text(text[-_MAX_ERROR_CHARS:])


class RunStore:
    """Runs, messages, turns and tool calls in one DuckDB file (or ``":memory:"`` for tests).

    ``price_fn(model, prompt_tokens, completion_tokens) -> usd | None`` prices turns whose usage
    has no cost; the default uses :mod:`closedloop.store.pricing`. ``flush_interval_s``: how long
    the background writer gathers queued writes (:meth:`log_step`) before it commits them (not a
    bound on when they are durable: :meth:`flush` is, see the module docstring);
    ``max_queued_steps``: how many may wait at most. ``create_dirs``: create a missing directory
    of ``path`` (the default location's always is), see :mod:`closedloop.store.location`.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, lock_timeout_s: float | None = None,
                 price_fn: pricing.PriceFn | None = None, detect_killed: bool = True,
                 flush_interval_s: float = 0.1, max_queued_steps: int = 1024, create_dirs: bool = False) -> None:
        if lock_timeout_s is None:  # $CLOSEDLOOP_STORE_LOCK_TIMEOUT, else 15 s
            lock_timeout_s = _lock_timeout_from_env()
        if not lock_timeout_s >= 0:
            raise ValueError("lock_timeout_s must be >= 0")
        if not (flush_interval_s >= 0 and math.isfinite(flush_interval_s)):
            raise ValueError("flush_interval_s must be a finite number >= 0")
        if isinstance(max_queued_steps, bool) or not isinstance(max_queued_steps, int) or max_queued_steps < 1:
            raise ValueError("max_queued_steps must be an int >= 1")
        self.lock_timeout_s = lock_timeout_s
        self.price_fn = price_fn or pricing.cost_usd
        self.detect_killed = detect_killed
        self.flush_interval_s = flush_interval_s
        self.max_queued_steps = max_queued_steps
        self._writer: BackgroundWriter | None = None
        self._queued_errors: list[BaseException] = []
        self._memory: duckdb.DuckDBPyConnection | None = None
        self._memory_lock = threading.Lock()  # one transaction at a time, as the file's lock gives
        if str(path) == ":memory:":
            self.path: Path | str = ":memory:"
            self._memory = duckdb.connect(":memory:")
        else:
            # The default location is closedloop's own directory and is created; a path the caller
            # names must be in an existing directory unless the caller asks (create_dirs).
            self.path = check_store_path(Path(path).expanduser() if path is not None else default_store_path(),
                                         create_dirs=create_dirs or path is None)
            self._lock = StoreLock(self.path)
        self._open()

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
        return version_on_file(con) == target_version() and not self._dead_runs(con)

    def __repr__(self) -> str:
        return f"RunStore({str(self.path)!r})"

    # ------------------------------------------------------------------ connections

    @contextmanager
    def _connect(self, deadline: float | None = None, *, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection for one transaction, under the store's lock (:mod:`closedloop.store.lock`):
        shared and ``read_only`` for reads, exclusive for writes; closed (DuckDB checkpoints on
        close) before the lock is released."""
        deadline = deadline if deadline is not None else time.monotonic() + self.lock_timeout_s
        if self._memory is not None:
            if not self._memory_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise StoreBusyError(f"run store {self.path}: another thread held it for {self.lock_timeout_s:g} s",
                                     waited_s=self.lock_timeout_s)
            try:
                con = self._memory.cursor()
                try:
                    yield con
                finally:
                    con.close()
            finally:
                self._memory_lock.release()
            return
        try:
            held = self._lock.hold(shared=read_only, deadline=deadline)
            held.__enter__()
        except LockTimeout as e:
            raise StoreBusyError.held(self.path, self.lock_timeout_s, e.holders[0] if e.holders else None) from None
        except OSError as e:  # the lock file beside the store cannot be created or opened
            raise StoreOpenError(f"run store {self.path}: cannot use its lock file {self._lock.path}: "
                                 f"{e.strerror or e}") from None
        try:
            con = self._open_file(deadline, read_only)
            try:
                yield con
            finally:
                con.close()
        except BaseException:
            if not held.__exit__(*sys.exc_info()):
                raise
        else:
            held.__exit__(None, None, None)

    def _open_file(self, deadline: float, read_only: bool) -> duckdb.DuckDBPyConnection:
        """``duckdb.connect``, waiting for a process outside the lock protocol (a ``duckdb`` shell
        on the file) that holds DuckDB's own lock."""
        delay = 0.005
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=read_only)
            except duckdb.IOException as e:
                if "lock" not in str(e).lower():
                    raise
                if time.monotonic() >= deadline:
                    raise StoreBusyError.locked(self.path, self.lock_timeout_s, str(e)) from None
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.2)

    def _tx(self, fn: Callable[[duckdb.DuckDBPyConnection], T],
            before: Callable[[duckdb.DuckDBPyConnection], Any] | None = None, *, read_only: bool = False) -> T:
        """Run ``fn`` in one transaction; a write-write conflict with another thread is retried whole.

        ``before`` runs on the same connection outside the transaction (migrations manage their own).
        ``read_only``: a read under the shared lock (``fn`` must not write).
        """
        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.005
        while True:
            try:
                with self._connect(deadline, read_only=read_only) as con:
                    if before is not None:
                        before(con)
                    con.execute("BEGIN TRANSACTION")
                    try:
                        result = fn(con)
                        con.execute("COMMIT")
                        return result
                    except BaseException:
                        try:
                            con.execute("ROLLBACK")
                        except duckdb.Error:
                            pass  # a failed COMMIT has already rolled back
                        raise
            except duckdb.TransactionException as e:
                if "conflict" not in str(e).lower():
                    raise
                if time.monotonic() >= deadline:
                    raise StoreBusyError(f"run store {self.path}: a write kept conflicting with another thread's "
                                         f"for {self.lock_timeout_s:g} s ({LOCK_TIMEOUT_ENV} waits longer)",
                                         waited_s=self.lock_timeout_s) from None
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.2)

    def read(self, fn: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
        """``fn`` (which only reads) under the shared lock on a read-only connection, the file released
        as soon as it returns: the public way for viewers and tools to run their own queries without
        disturbing a writer in another process. Runs whose writer died are marked
        ``killed`` first (that is a write: it takes the exclusive lock, and only when there are
        such runs), so a read never shows a dead run as running."""
        def read(con: duckdb.DuckDBPyConnection) -> tuple[bool, T | None]:
            if self._dead_runs(con):
                return True, None
            return False, fn(con)

        for _ in range(3):
            dead, result = self._tx(read, read_only=True)
            if not dead:
                return result  # type: ignore[return-value]
            self._tx(self._reap)
        return self._tx(fn, read_only=True)  # runs keep dying as we look: show them as they are

    # ------------------------------------------------------------------ runs

    def start_run(self, *, kind: str = "run", graph: str | None = None, model_spec: str | None = None,
                  config: Any = None, tags: Sequence[str] | None = None, metadata: Mapping[str, Any] | None = None,
                  parent_id: str | None = None, run_id: str | None = None) -> str:
        """Open a run owned by this process; returns its id."""
        if not kind or not isinstance(kind, str):
            raise ValueError("kind must be a non-empty string such as 'run', 'eval' or 'train'")
        run_id = run_id or _new_id()
        secrets = _env_secrets()
        cfg = redact(_jsonable(config) or {}, env_secrets=secrets)
        meta = redact(_jsonable(metadata) or {}, env_secrets=secrets)
        if not isinstance(cfg, dict) or not isinstance(meta, dict):
            raise TypeError("config and metadata must be mappings (dict, pydantic model or dataclass)")
        spec = redact_spec(model_spec)  # ``openai:m@http://user:key@host`` never reaches the file
        labels, graph = _redacted_tags(tags, secrets), _redacted_label(graph, secrets)
        self._tx(lambda con: self._insert_run(con, run_id, kind, graph, spec, cfg, labels, meta, parent_id))
        return run_id

    @staticmethod
    def _insert_run(con: duckdb.DuckDBPyConnection, run_id: str, kind: str, graph: str | None, model_spec: str | None,
                    cfg: dict[str, Any], tags: Sequence[str] | None, meta: dict[str, Any], parent_id: str | None) -> None:
        if con.execute("SELECT 1 FROM runs WHERE id = ?", [run_id]).fetchone():
            raise RunStateError(f"a run with id {run_id!r} already exists")
        pid = os.getpid()
        now = utcnow()
        con.execute("INSERT INTO runs (id, kind, graph, model_spec, config, status, pid, hostname, proc_start, "
                    "parent_id, closedloop_version, started_at, updated_at, tags, metadata) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [run_id, kind, graph, model_spec, _dumps(cfg), "running", pid, hostname(), process_start(pid),
                     parent_id, closedloop.__version__, now, now, list(tags or []), _dumps(meta)])

    def finish_run(self, run_id: str, status: str = "completed", outcome: Mapping[str, Any] | None = None,
                   error: BaseException | str | None = None) -> None:
        """Close a running run with a terminal status, its outcome (answer, rewards) and error."""
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"status must be one of {TERMINAL_STATUSES}, got {status!r}")
        out = redact(_jsonable(outcome), keys=False, key_values=False) if outcome is not None else None
        if out is not None and not isinstance(out, dict):
            raise TypeError("outcome must be a mapping, e.g. {'answer': ..., 'rewards': {...}}")
        err = _format_error(error)
        self._flush_pending()  # everything the run queued lands before it is marked finished
        self._tx(lambda con: self._write_finish(con, run_id, status, out, err))

    def _write_finish(self, con: duckdb.DuckDBPyConnection, run_id: str, status: str, out: dict[str, Any] | None,
                      err: str | None) -> None:
        self._require_running(con, run_id)
        now = utcnow()
        con.execute("UPDATE runs SET status = ?, outcome = ?, error = ?, ended_at = ?, updated_at = ? WHERE id = ?",
                    [status, _dumps(out), err, now, now, run_id])

    def run(self, **start_kwargs: Any) -> "ActiveRun":
        """``with store.run(graph=...) as run:`` completed on exit, failed on exception,
        interrupted on KeyboardInterrupt/CancelledError. Also ``async with``."""
        return ActiveRun(self, start_kwargs)

    @staticmethod
    def _require_running(con: duckdb.DuckDBPyConnection, run_id: str) -> tuple[str | None, bool]:
        """Raise unless the run exists and is running; returns its model_spec (to price turns) and
        whether a credential was redacted from its texts already (its turns then keep no token ids)."""
        row = con.execute("SELECT status, model_spec, secrets_redacted FROM runs WHERE id = ?", [run_id]).fetchone()
        if row is None:
            raise RunNotFoundError(f"no run with id {run_id!r}")
        if row[0] != "running":
            raise RunStateError(f"run {run_id} is {row[0]}; only running runs can be written to")
        return row[1], bool(row[2])

    # ------------------------------------------------------------------ children

    def log_messages(self, run_id: str, messages: Sequence[_Message | dict[str, Any]], *, replace: bool = False) -> int:
        """Append messages (or, with ``replace``, rewrite the run's message list); returns the count."""
        typed = parse_messages(list(messages))
        secrets = _env_secrets()
        sink = MediaSink()
        rows = [prepare_message(m, secrets, sink) for m in typed]
        self._flush_pending()
        return self._tx(lambda con: self._write_messages(con, run_id, rows, replace, sink))

    def _write_messages(self, con: duckdb.DuckDBPyConnection, run_id: str, rows: list[tuple[str, str, bool]],
                        replace: bool, sink: MediaSink | None = None) -> int:
        self._require_running(con, run_id)
        if sink is not None and sink.blobs:
            write_media(con, sink, [(run_id, h) for h in sink.blobs], utcnow())
        if replace:
            con.execute("DELETE FROM messages WHERE run_id = ?", [run_id])
        start = _next_idx(con, "messages", run_id)
        for i, (role, js, _) in enumerate(rows):
            _insert_message(con, run_id, start + i, role, js)
        con.execute("UPDATE runs SET updated_at = ?, secrets_redacted = secrets_redacted OR ? WHERE id = ?",
                    [utcnow(), any(r[2] for r in rows), run_id])
        return len(rows)

    def log_turn(self, run_id: str, turn: Turn) -> int:
        """Record one model call token-exactly; adds its usage and cost to the run. Returns its index."""
        if not isinstance(turn, Turn):
            raise TypeError(f"log_turn takes a closedloop.messages.Turn, got {type(turn).__name__}")
        sink = MediaSink()
        prepared = prepare_turn(turn, _env_secrets(), media=sink)
        self._flush_pending()
        return self._tx(lambda con: self._write_turn(con, run_id, prepared, sink))

    def _price(self, turn: PreparedTurn, model_spec: str | None,
               price_fn: Callable[[str, int, int], float | None] | None = None) -> float | None:
        if turn.cost_usd is not None:
            return turn.cost_usd
        return (price_fn or self.price_fn)(turn.model or model_spec or "", turn.prompt_tokens, turn.completion_tokens)

    def _write_turn(self, con: duckdb.DuckDBPyConnection, run_id: str, prepared: PreparedTurn,
                    sink: MediaSink | None = None) -> int:
        model_spec, tainted = self._require_running(con, run_id)
        if tainted:  # its prompt holds the conversation, from which a credential was redacted
            prepared = without_token_ids(prepared)
        if sink is not None and sink.blobs:
            write_media(con, sink, [(run_id, h) for h in sink.blobs], utcnow())
        cost = self._price(prepared, model_spec)
        idx = _next_idx(con, "turns", run_id)
        now = utcnow()
        con.execute(_INSERT_TURN, turn_row(run_id, idx, prepared, cost, now))
        con.execute("UPDATE runs SET prompt_tokens = prompt_tokens + ?, completion_tokens = completion_tokens + ?, "
                    "cost_usd = CASE WHEN ?::DOUBLE IS NULL THEN cost_usd ELSE coalesce(cost_usd, 0) + ?::DOUBLE END, "
                    "updated_at = ?, secrets_redacted = secrets_redacted OR ? WHERE id = ?",
                    [prepared.prompt_tokens, prepared.completion_tokens, cost, cost, now, prepared.redacted, run_id])
        return idx

    def log_tool_call(self, run_id: str, call: ToolCall, result: ToolResult, turn_idx: int | None = None) -> int:
        """Record a tool call and what it returned; ``turn_idx`` defaults to the latest turn."""
        p = _prepare_call(call, result, _env_secrets())

        def write(con: duckdb.DuckDBPyConnection) -> int:
            self._require_running(con, run_id)
            t_idx = _turn_idx(turn_idx)
            if t_idx is None:
                t_idx = con.execute("SELECT max(idx) FROM turns WHERE run_id = ?", [run_id]).fetchone()[0]
            idx = _next_idx(con, "tool_calls", run_id)
            now = utcnow()
            con.execute("INSERT INTO tool_calls VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [run_id, idx, t_idx, p.call_id, p.name, p.arguments, p.result, p.error, p.error_kind,
                         p.latency_s, now])
            con.execute("UPDATE runs SET updated_at = ? WHERE id = ?", [now, run_id])
            return idx

        self._flush_pending()
        return self._tx(write)

    # ------------------------------------------------------------------ queued writes

    def log_step(self, run_id: str, messages: Sequence[_Message | dict[str, Any]] = (), turns: Sequence[Turn] = (),
                 tool_calls: Sequence[tuple[ToolCall, ToolResult, int | None]] = (), *, replace: bool = False) -> None:
        """Queue what one graph step added; returns at once (microseconds), never touching the file.

        A background thread commits queued steps in order, one transaction per
        ``flush_interval_s``. The objects are serialised on that thread: do not mutate them after
        the call. Errors (the run is not running, a store problem) cannot be raised here; they are
        warned about and raised by the next :meth:`flush`. ``tool_calls`` are ``(call, result,
        turn_idx)``; ``turn_idx=None`` means the run's latest turn at that point.
        """
        if any(not isinstance(m, _Message) for m in messages):
            messages = parse_messages(list(messages))
        for t in turns:
            if not isinstance(t, Turn):
                raise TypeError(f"log_step takes closedloop.messages.Turn objects, got {type(t).__name__}")
        if messages or turns or tool_calls or replace:
            self._enqueue(_Step(run_id, list(messages), list(turns), list(tool_calls), [], replace))

    def flush(self) -> None:
        """Commit every queued write now; then raise the first queued write that failed since the
        last ``flush`` (a :class:`RunStateError` for a step logged to a finished run, say).

        The ack point of the queued path: when it returns, every step logged before it survives a
        SIGKILL of this process."""
        self._flush_pending()
        if self._queued_errors:
            errors, self._queued_errors = self._queued_errors, []
            more = f" ({len(errors) - 1} more queued write(s) failed too)" if len(errors) > 1 else ""
            raise type(errors[0])(f"{errors[0]}{more}") from errors[0]

    def _enqueue(self, step: "_Step") -> None:
        if self._writer is None:
            self._writer = BackgroundWriter(self._write_steps, interval_s=self.flush_interval_s,
                                            name=f"closedloop-store-writer:{self.path}", retryable=(StoreBusyError,),
                                            max_pending=self.max_queued_steps)
            _open_stores.add(self)
        self._writer.submit(step)

    def _flush_pending(self) -> None:
        """Read-your-writes and ordering: queued steps commit before any direct write or read."""
        writer = self._writer
        if writer is not None:
            writer.flush()  # also waits for a batch the background thread is writing right now
            self._queued_errors.extend(writer.errors)
            writer.errors.clear()

    def _write_steps(self, steps: list["_Step"]) -> None:
        """Queued steps, possibly of several runs, in one transaction.

        One run's problem never costs another run its rows: a step that cannot be prepared is
        dropped alone (and reported by the next :meth:`flush`); when the batch's transaction fails
        for any reason but the lock (retried whole by the writer), its steps are written again one
        transaction each, so only a step that fails on its own is dropped.
        """
        secrets = _env_secrets()
        sink = MediaSink()
        prepared: list[_PreparedStep] = []
        for s in steps:
            try:
                prepared.append(_prepare_step(s, secrets, sink))
            except Exception as e:  # noqa: BLE001 - a bug meeting odd input: that step alone is lost, and said so
                sink.take()
                self._report_dropped(s.run_id, e)
        if not prepared:
            return
        try:
            failed = self._tx(lambda con: self._write_prepared(con, prepared, sink))
        except StoreBusyError as busy:
            raise PartialBatch([p.step for p in prepared], busy) from None
        except Exception as e:  # noqa: BLE001 - isolate the step that fails, keep the others
            if len(prepared) == 1:
                failed = {prepared[0].step.run_id: e}
            else:
                failed = {}
                for i, p in enumerate(prepared):
                    try:
                        failed.update(self._tx(lambda con, one=[p]: self._write_prepared(con, one, sink)))
                    except StoreBusyError as busy:
                        raise PartialBatch([q.step for q in prepared[i:]], busy) from None
                    except Exception as one_error:  # noqa: BLE001
                        failed.setdefault(p.step.run_id, one_error)
        for rid, error in failed.items():
            self._report_dropped(rid, error)

    def _report_dropped(self, run_id: str, error: BaseException) -> None:
        warnings.warn(f"run store: queued writes for run {run_id} were dropped: {error}", RuntimeWarning, stacklevel=3)
        if self._writer is not None:
            self._writer.errors.append(error)

    def _write_prepared(self, con: duckdb.DuckDBPyConnection, prepared: list["_PreparedStep"],
                        sink: MediaSink) -> dict[str, BaseException]:
        """The rows of prepared steps, in the caller's transaction; returns the runs not written
        to (gone or not running) with the reason."""
        failed: dict[str, BaseException] = {}
        ids = sorted({p.step.run_id for p in prepared})
        state = {r[0]: (r[1], r[2], bool(r[3])) for r in con.execute(
            "SELECT id, status, model_spec, secrets_redacted FROM runs WHERE list_contains(?, id)", [ids]).fetchall()}
        live = [i for i in ids if state.get(i, ("",))[0] == "running"]
        nxt = {t: _next_indices(con, t, live) for t in ("messages", "turns", "tool_calls")}
        rows, now, pricer = Rows(), utcnow(), Pricer(self.price_fn)
        totals: dict[str, list[Any]] = {}
        tainted = {rid for rid in live if state[rid][2]}
        media_refs = []
        for p in prepared:
            rid = p.step.run_id
            if rid not in nxt["turns"]:
                if rid not in failed:
                    failed[rid] = (RunNotFoundError(f"no run with id {rid!r}") if rid not in state else
                                   RunStateError(f"run {rid} is {state[rid][0]}; only running runs can be written to"))
                continue
            media_refs += [(rid, h) for h in p.media]
            tot = totals.setdefault(rid, [0, 0, None])
            if p.step.replace:
                con.execute("DELETE FROM messages WHERE run_id = ?", [rid])
                rows.drop_run("messages", rid)
                nxt["messages"][rid] = 0
            for role, js in p.episode.messages:
                rows.add("messages", (rid, _take(nxt["messages"], rid), role, js))
            for t in p.episode.turns:
                if rid in tainted:  # an earlier step lost a secret: this prompt still holds it
                    t = without_token_ids(t)
                cost = self._price(t, state[rid][1], pricer)
                rows.add("turns", turn_row(rid, _take(nxt["turns"], rid), t, cost, now))
                tot[0] += t.prompt_tokens
                tot[1] += t.completion_tokens
                if cost is not None:
                    tot[2] = (tot[2] or 0.0) + cost
            if p.episode.redacted:
                tainted.add(rid)
            for c, turn_idx in p.calls:
                t_idx = turn_idx if turn_idx is not None else (nxt["turns"][rid] - 1 if nxt["turns"][rid] else None)
                rows.add("tool_calls", (rid, _take(nxt["tool_calls"], rid), t_idx, c.call_id, c.name, c.arguments,
                                        c.result, c.error, c.error_kind, c.latency_s, now))
            for step_no, name, value in p.step.metrics:
                rows.add("metrics", (rid, step_no, name, value, now))
        if media_refs:  # media of live runs only (a dropped step's bytes are not kept)
            write_media(con, sink, media_refs, now)
        rows.insert(con)
        if totals:
            con.execute("UPDATE runs SET prompt_tokens = runs.prompt_tokens + d.p, "
                        "completion_tokens = runs.completion_tokens + d.c, "
                        "cost_usd = CASE WHEN d.cost IS NULL THEN runs.cost_usd "
                        "ELSE coalesce(runs.cost_usd, 0) + d.cost END, updated_at = ?, "
                        "secrets_redacted = runs.secrets_redacted OR d.tainted "
                        "FROM (SELECT unnest(?::VARCHAR[]) AS id, unnest(?::BIGINT[]) AS p, unnest(?::BIGINT[]) AS c, "
                        "unnest(?::DOUBLE[]) AS cost, unnest(?::BOOLEAN[]) AS tainted) AS d WHERE runs.id = d.id",
                        [now, list(totals), [v[0] for v in totals.values()], [v[1] for v in totals.values()],
                         [v[2] for v in totals.values()], [rid in tainted for rid in totals]])
        return failed

    # ------------------------------------------------------------------ metrics

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
            entries = _metric_entries([(step, metrics)])
        elif isinstance(step, int):
            raise TypeError("log_metrics(run_id, step, metrics): metrics is missing")
        else:
            entries = _metric_entries(step)
        if not wait:
            self._enqueue(_Step(run_id, [], [], [], entries, False))
            return len(entries)

        def write(con: duckdb.DuckDBPyConnection) -> int:
            self._require_running(con, run_id)
            now = utcnow()
            rows = Rows()
            for step_no, name, value in entries:
                rows.add("metrics", (run_id, step_no, name, value, now))
            rows.insert(con)
            con.execute("UPDATE runs SET updated_at = ? WHERE id = ?", [now, run_id])
            return len(entries)

        self._flush_pending()
        return self._tx(write)

    def metrics(self, run_id: str) -> list[dict[str, float]]:
        """Per-step metrics of a run, oldest step first: ``[{"step": 0, "loss": ..., ...}, ...]``."""
        self._flush_pending()

        def read(con: duckdb.DuckDBPyConnection) -> list[tuple[int, str, float]]:
            full = _resolve(con, run_id)
            return con.execute("SELECT step, name, value FROM metrics WHERE run_id = ? "
                               "ORDER BY step, created_at, rowid", [full]).fetchall()

        by_step: dict[int, dict[str, Any]] = {}
        for step_no, name, value in self._tx(read, read_only=True):
            by_step.setdefault(step_no, {"step": step_no})[name] = value
        return list(by_step.values())

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
        spec = _EpisodeSpec(trajectory, outcome, started_at, error)
        return self._record(_RunDefaults(kind, status, graph, model_spec, config, tags, parent_id), [spec])[0]

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
        specs = [_EpisodeSpec(t, outcomes[i] if outcomes is not None else None, None, None)
                 for i, t in enumerate(trajectories)]
        return self._record(_RunDefaults(kind, status, graph, model_spec, config, tags, parent_id), specs)

    def _record(self, defaults: "_RunDefaults", specs: list["_EpisodeSpec"]) -> list[str]:
        if defaults.status not in TERMINAL_STATUSES:
            raise ValueError(f"status must be one of {TERMINAL_STATUSES}, got {defaults.status!r}")
        if not defaults.kind or not isinstance(defaults.kind, str):
            raise ValueError("kind must be a non-empty string such as 'run', 'eval' or 'train'")
        for spec in specs:
            if not isinstance(spec.trajectory, Trajectory):
                raise TypeError(f"expected closedloop.messages.Trajectory, got {type(spec.trajectory).__name__}")
        ids = [s.trajectory.id for s in specs]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"trajectory ids repeat within the batch: {', '.join(dup[:5])}")
        if not specs:
            return []
        with gc_paused():
            return self._record_batch(defaults, specs, ids)

    def _record_batch(self, defaults: "_RunDefaults", specs: list["_EpisodeSpec"], ids: list[str]) -> list[str]:
        """Everything is prepared (redacted, encoded, priced, laid out in rows) before the
        transaction, so the file is held only for the inserts."""
        secrets = _env_secrets()
        cfg = _dumps(redact(_jsonable(defaults.config) or {}, env_secrets=secrets))
        tags = _redacted_tags(defaults.tags, secrets)
        graph = _redacted_label(defaults.graph, secrets)
        pid, host = os.getpid(), hostname()
        proc = process_start(pid)
        version = closedloop.__version__
        rows, now, pricer = Rows(), utcnow(), Pricer(self.price_fn)
        sink, media_refs = MediaSink(), []
        for spec in specs:
            traj = spec.trajectory
            run_id = traj.id
            meta = _redacted_json(traj.metadata or {}, secrets)
            out = _redacted_json({"rewards": traj.rewards,
                                  **({"step_rewards": traj.step_rewards} if traj.step_rewards else {}),
                                  **(_jsonable(spec.outcome) or {})}, secrets, keys=False, key_values=False)
            messages, turns, redacted = prepare_episode(traj.messages, traj.turns, secrets, sink)
            if sink.pending:
                media_refs += [(run_id, h) for h in sink.take()]
            rows.extend("messages", [(run_id, i, role, js) for i, (role, js) in enumerate(messages)])
            p_tok = c_tok = 0
            cost: float | None = None
            turn_rows = rows.tables["turns"]
            for i, t in enumerate(turns):
                c = t.cost_usd if t.cost_usd is not None else pricer(t.model or defaults.model_spec or "",
                                                                    t.prompt_tokens, t.completion_tokens)
                turn_rows.append(turn_row(run_id, i, t, c, now))
                p_tok += t.prompt_tokens
                c_tok += t.completion_tokens
                if c is not None:
                    cost = (cost or 0.0) + c
            rows.add("runs", (run_id, defaults.kind, graph, redact_spec(defaults.model_spec), cfg, defaults.status,
                              pid, host, proc, defaults.parent_id, version, spec.started_at or now, now, now, out,
                              _format_error(spec.error), p_tok, c_tok, cost, tags, meta, redacted))

        def write(con: duckdb.DuckDBPyConnection) -> list[str]:
            # A semi-join (hashed), not list_contains: that compares every run with every new id.
            taken = con.execute("SELECT id FROM runs WHERE id IN (SELECT unnest(?::VARCHAR[])) LIMIT 5",
                                [ids]).fetchall()
            if taken:
                raise RunStateError(f"a run with id {taken[0][0]!r} already exists"
                                    + (f" (and {len(taken) - 1} more)" if len(taken) > 1 else ""))
            if media_refs:
                write_media(con, sink, media_refs, now)
            rows.insert(con)
            return ids

        return self._tx(write, before=_bulk_settings if self._memory is None else None)

    def reopen_run(self, run_id: str, config: Any = None) -> None:
        """Make a finished run ``running`` again, owned by this process (resuming a long job such as an
        evaluation under the same id). Refuses a run that is still running: two writers would
        duplicate work. Its metadata counts the attempts and keeps the earlier statuses."""
        pid = os.getpid()
        cfg = redact(_jsonable(config), env_secrets=_env_secrets()) if config is not None else None

        def write(con: duckdb.DuckDBPyConnection) -> None:
            self._reap(con)
            row = con.execute("SELECT status, pid, hostname, metadata, config FROM runs WHERE id = ?",
                              [run_id]).fetchone()
            if row is None:
                raise RunStateError(f"no run {run_id}")
            status, old_pid, host, meta, old_cfg = row
            if status == "running":
                raise RunStateError(f"run {run_id} is still running (pid {old_pid} on {host}); stop it first")
            meta = json.loads(meta) if isinstance(meta, str) else (meta or {})
            meta["attempts"] = int(meta.get("attempts", 1)) + 1
            meta.setdefault("previous_status", []).append(status)
            new_cfg = json.dumps(cfg) if cfg is not None else old_cfg
            con.execute("UPDATE runs SET status = 'running', pid = ?, hostname = ?, proc_start = ?, ended_at = NULL, "
                        "error = NULL, outcome = NULL, config = ?, metadata = ?, updated_at = ? WHERE id = ?",
                        [pid, hostname(), process_start(pid), new_cfg, json.dumps(meta), utcnow(), run_id])

        self._tx(write)

    # ------------------------------------------------------------------ reading

    def get_run(self, run_id: str, *, media: MediaMode = "inline") -> RunRecord:
        """The run with its messages, turns and tool calls; accepts a unique id prefix.

        ``media="inline"`` (default) gives image/audio parts back exactly as recorded;
        ``"refs"`` leaves them as ``closedloop-media:sha256:...`` references without reading the
        bytes (see :meth:`media_bytes`)."""
        _check_media_mode(media)
        self._flush_pending()

        def read(con: duckdb.DuckDBPyConnection) -> RunRecord:
            full = _resolve(con, run_id)
            summary = _summaries(con, "WHERE id = ?", [full])[0]
            raw = [r[0] for r in con.execute("SELECT json FROM messages WHERE run_id = ? ORDER BY idx",
                                             [full]).fetchall()]
            turn_rows = con.execute(f"SELECT {_TURN_READ} FROM turns WHERE run_id = ? ORDER BY idx", [full]).fetchall()
            restore = _restorer(con, raw, turn_rows, 1) if media == "inline" else None
            msgs = _messages_from_json([restore(js) for js in raw] if restore is not None else raw)
            by_json = dict(zip(raw, msgs))
            turns = [_turn_from_row(r, by_json, restore) for r in turn_rows]
            cur = con.execute("SELECT idx, turn_idx, call_id, name, arguments, result, error, error_kind, latency_s "
                              "FROM tool_calls WHERE run_id = ? ORDER BY idx", [full])
            cols = [d[0] for d in cur.description]
            calls = [ToolCallRecord(**dict(zip(cols, r))) for r in cur.fetchall()]
            return RunRecord(**summary.model_dump(), messages=msgs, turns=turns, tool_calls=calls)

        return self.read(read)

    def load_trajectory(self, run_id: str, *, media: MediaMode = "inline") -> Trajectory:
        """The run as a trainer sees it (see :meth:`RunRecord.to_trajectory`); ``media`` as in :meth:`get_run`."""
        return self.get_run(run_id, media=media).to_trajectory()

    def media_bytes(self, sha256: str) -> bytes:
        """The bytes of one stored image/audio (by the hash a reference or ``MediaRef`` names)."""
        digest = sha256.removeprefix("sha256:")
        self._flush_pending()
        found = self._tx(lambda con: fetch_media(con, [digest]), read_only=True)
        if digest not in found:
            raise KeyError(f"no media sha256:{digest} in {self.path}")
        return found[digest]

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
        released before the batch is decoded and yielded, so a slow consumer never holds the file. Each trajectory equals ``load_trajectory(id)``: rewards
        and step rewards from the run's outcome, ``metadata`` with ``run_id``, ``kind``, ``graph``,
        ``parent_id``, ... and ``task_id`` (see :func:`closedloop.store.records.trajectory_metadata`).
        ``media``: as in :meth:`get_run` (``"refs"`` reads no media bytes: large exports).
        """
        _check_media_mode(media)
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if limit is not None and limit < 0:
            raise ValueError("limit must be >= 0")
        if status is not None and status not in ("running",) + TERMINAL_STATUSES:
            raise ValueError(f"status must be one of {('running',) + TERMINAL_STATUSES}, got {status!r}")
        where, params = [], []
        for column, value in (("status", status), ("graph", _redacted_label(graph)), ("kind", kind),
                              ("parent_id", parent_id), ("model_spec", redact_spec(model_spec))):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if tag is not None:
            where.append("list_contains(tags, ?)")
            params.append(_redacted_label(tag))
        want = dict(_jsonable(metadata) or {})
        self._flush_pending()

        def select(con: duckdb.DuckDBPyConnection) -> list[tuple[str, dict[str, float], list[Any], dict[str, Any]]]:
            heads = con.execute(
                "SELECT id, kind, graph, model_spec, status, parent_id, tags, metadata, "
                "json_extract(config, '$.task_id'), json_extract(outcome, '$.task_id'), "
                "json_extract(outcome, '$.rewards'), json_extract(outcome, '$.step_rewards') FROM runs "
                + ("WHERE " + " AND ".join(where) if where else "") + " ORDER BY started_at, rowid", params).fetchall()
            selected = []
            for (rid, kind_, graph_, spec, status_, parent, tags, meta, cfg_task, out_task, rewards_js,
                 steps_js) in heads:
                meta = _loads(meta) or {}
                if any(meta.get(k) != v for k, v in want.items()):
                    continue
                rewards = reward_dict(rid, _loads(rewards_js))
                if min_reward is not None and (not rewards or sum(rewards.values()) < min_reward):
                    continue
                md = trajectory_metadata(run_id=rid, kind=kind_, graph=graph_, model_spec=spec, status=status_,
                                         tags=tags or [], parent_id=parent, metadata=meta,
                                         config_task_id=_loads(cfg_task), outcome_task_id=_loads(out_task))
                selected.append((rid, rewards, list(_loads(steps_js) or []), md))
                if limit is not None and len(selected) >= limit:
                    break
            return selected

        def read(con: duckdb.DuckDBPyConnection, ids: list[str]) -> tuple[dict[str, list[str]],
                                                                          dict[str, list[tuple[Any, ...]]],
                                                                          Restorer | None]:
            msgs: dict[str, list[str]] = {i: [] for i in ids}
            rows: dict[str, list[tuple[Any, ...]]] = {i: [] for i in ids}
            restore = None
            if ids:
                raw = con.execute("SELECT run_id, json FROM messages WHERE run_id IN "
                                  "(SELECT unnest(?::VARCHAR[])) ORDER BY run_id, idx", [ids]).fetchall()
                for rid, js in raw:
                    msgs[rid].append(js)
                turn_rows = con.execute(f"SELECT run_id, {_TURN_READ} FROM turns WHERE run_id IN "
                                        "(SELECT unnest(?::VARCHAR[])) ORDER BY run_id, idx", [ids]).fetchall()
                for row in turn_rows:
                    rows[row[0]].append(row[1:])
                if media == "inline":  # the bytes are fetched here, restored after the file is released
                    restore = _restorer(con, (js for _, js in raw), turn_rows, 2)
            return msgs, rows, restore

        def select_and_first(con: duckdb.DuckDBPyConnection) -> tuple[list[Any], tuple[Any, Any]]:
            # The first batch is read on the selecting connection: opening the file costs ~15 ms of
            # CPU (DuckDB builds its catalog), as much as decoding ~1,000 turns.
            selected = select(con)
            return selected, read(con, [c[0] for c in selected[:batch_size]])

        selected, first = self.read(select_and_first)
        for start in range(0, len(selected), batch_size):
            chunk = selected[start:start + batch_size]
            if start == 0:
                msgs, rows, restore = first
                first = None
            else:
                ids = [c[0] for c in chunk]
                msgs, rows, restore = self._tx(lambda con: read(con, ids), read_only=True)  # decoded after release
            with gc_paused():
                out = []
                for rid, rewards, step_rewards, md in chunk:
                    raw = msgs[rid]
                    messages = _messages_from_json([restore(js) for js in raw] if restore is not None else raw)
                    by_json = dict(zip(raw, messages))
                    out.append(Trajectory.model_construct(id=rid, messages=messages,
                                                          turns=[_turn_from_row(r, by_json, restore)
                                                                 for r in rows[rid]],
                                                          rewards=rewards, step_rewards=step_rewards, metadata=md))
            del msgs, rows, restore
            yield from out

    def list_runs(self, limit: int | None = 50, status: str | None = None, graph: str | None = None,
                  kind: str | None = None, parent_id: str | None = None, tag: str | None = None) -> list[RunSummary]:
        """Newest first."""
        if limit is not None and limit < 0:
            raise ValueError("limit must be >= 0")
        where, params = [], []
        for column, value in (("status", status), ("graph", _redacted_label(graph)), ("kind", kind),
                              ("parent_id", parent_id)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if tag is not None:
            where.append("list_contains(tags, ?)")
            params.append(_redacted_label(tag))
        clause = ("WHERE " + " AND ".join(where) if where else "") + " ORDER BY started_at DESC, id"
        if limit is not None:
            clause += f" LIMIT {int(limit)}"
        self._flush_pending()

        return self.read(lambda con: _summaries(con, clause, params))

    def resolve_id(self, prefix: str) -> str:
        return self._tx(lambda con: _resolve(con, prefix), read_only=True)

    # ------------------------------------------------------------------ maintenance

    def reap_killed(self) -> list[str]:
        """Mark ``killed`` the running runs of this host whose process is gone; returns their ids.

        Their ``ended_at`` is the last write we saw, the closest we know to when they died.
        """
        return self._tx(self._reap)

    def _dead_runs(self, con: duckdb.DuckDBPyConnection) -> list[tuple[str, int]]:
        """(id, pid) of this host's running runs whose process is gone (a read)."""
        if not self.detect_killed:
            return []
        rows = con.execute("SELECT id, pid, proc_start FROM runs WHERE status = 'running' AND hostname = ?",
                           [hostname()]).fetchall()
        return [(rid, pid) for rid, pid, start in rows if not pid_alive(pid, start)]

    def _reap(self, con: duckdb.DuckDBPyConnection) -> list[str]:
        """Runs inside the caller's (write) transaction, so a write and the reaping share one connection."""
        dead = self._dead_runs(con)
        host = hostname()
        for rid, pid in dead:
            con.execute("UPDATE runs SET status = 'killed', ended_at = updated_at, error = ? "
                        "WHERE id = ? AND status = 'running'",
                        [f"process {pid} on {host} exited without finishing the run "
                         f"(detected {utcnow():%Y-%m-%d %H:%M:%S} UTC)", rid])
        return [rid for rid, _ in dead]

    def delete_older_than(self, age: timedelta) -> int:
        """Delete finished runs that ended more than ``age`` ago, with their child rows; returns how many.

        Running runs are never deleted, however old: a long training job is still writing to them.
        """
        if not isinstance(age, timedelta) or age < timedelta(0):
            raise ValueError("age must be a non-negative timedelta")
        cutoff = utcnow() - age
        self._flush_pending()

        def write(con: duckdb.DuckDBPyConnection) -> int:
            self._reap(con)
            ids = [r[0] for r in con.execute("SELECT id FROM runs WHERE status <> 'running' AND "
                                             "coalesce(ended_at, updated_at) < ?", [cutoff]).fetchall()]
            if not ids:
                return 0
            for table in ("messages", "turns", "tool_calls", "metrics"):
                con.execute(f"DELETE FROM {table} WHERE list_contains(?, run_id)", [ids])
            con.execute("DELETE FROM runs WHERE list_contains(?, id)", [ids])
            collect_garbage(con, ids)  # media no remaining run references
            return len(ids)

        return self._tx(write)

    def export_parquet(self, directory: str | os.PathLike[str], *, media: MediaMode = "inline") -> dict[str, Path]:
        """One Parquet file per table, written by DuckDB from one consistent snapshot.

        ``media="inline"``: message JSON (``messages.json``, ``turns.message``) holds image/audio
        parts as recorded (base64), so each file stands alone; ``"refs"``: it keeps the stored
        references and ``media.parquet`` (sha256, mime, size, data) holds each blob once."""
        _check_media_mode(media)
        self._flush_pending()
        out = Path(directory).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        tables = TABLES + (("media",) if media == "refs" else ())
        paths = {t: (out / f"{t}.parquet").resolve() for t in tables}

        def write(con: duckdb.DuckDBPyConnection) -> dict[str, Path]:
            # Media rows are immutable, so a second cursor may look them up while a table streams.
            lookup = con.cursor() if media == "inline" and con.execute(
                "SELECT count(*) FROM (SELECT 1 FROM run_media LIMIT 1)").fetchone()[0] else None
            try:
                for table, path in paths.items():
                    quoted = str(path).replace("'", "''")
                    if table == "turns":  # the array BLOBs go out as the lists they encode
                        _export_turns(con, path, lookup)
                        continue
                    if table == "messages" and lookup is not None:
                        _export_restored(con, "messages", "json", path, lookup)
                        continue
                    query = (f"SELECT * FROM {table} ORDER BY ALL" if table != "media" else  # each hash once
                             "SELECT sha256, any_value(mime) AS mime, any_value(size) AS size, "
                             "any_value(data) AS data, min(created_at) AS created_at FROM media "
                             "GROUP BY sha256 ORDER BY sha256")
                    con.execute(f"COPY ({query}) TO '{quoted}' (FORMAT parquet)")
            finally:
                if lookup is not None:
                    lookup.close()
            return paths

        return self.read(write)

    def close(self) -> None:
        """Commit queued writes and stop the background writer (a later queued write restarts it)."""
        writer = self._writer
        if writer is not None:
            writer.close()
            self._queued_errors.extend(writer.errors)
            self._writer = None
            _open_stores.discard(self)
        if self._memory is not None:
            self._memory.close()
            self._memory = None


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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
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

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        return self.__exit__(exc_type, exc, tb)


# ---------------------------------------------------------------------- row helpers


@dataclass(slots=True)
class _Step:
    """What one ``log_step`` (or ``log_metrics(wait=False)``) queued for a run."""

    run_id: str
    messages: list[_Message]
    turns: list[Turn]
    tool_calls: list[tuple[ToolCall, ToolResult, int | None]]
    metrics: list[tuple[int, str, float]]
    replace: bool = False


@dataclass(slots=True)
class _RunDefaults:
    kind: str
    status: str
    graph: str | None
    model_spec: str | None
    config: Any
    tags: Sequence[str] | None
    parent_id: str | None


@dataclass(slots=True)
class _EpisodeSpec:
    trajectory: Trajectory
    outcome: Mapping[str, Any] | None
    started_at: datetime | None
    error: BaseException | str | None


# Stores with a background writer, flushed at interpreter exit (atexit runs before daemon threads die).
_open_stores: "weakref.WeakSet[RunStore]" = weakref.WeakSet()


def _forget_queues_in_child() -> None:
    """A forked child must not write its parent's queued steps a second time (the parent will)."""
    for store in list(_open_stores):
        store._writer = None
    _open_stores.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_queues_in_child)


@atexit.register
def _flush_at_exit() -> None:
    for store in list(_open_stores):
        try:
            store.close()
        except Exception as e:  # noqa: BLE001 - exit must go on; say what was lost
            warnings.warn(f"run store {store.path}: queued writes could not be committed at exit: {e}",
                          RuntimeWarning, stacklevel=1)


_INSERT_TURN = f"INSERT INTO turns ({', '.join(TURN_COLUMNS)}) VALUES ({', '.join('?' * len(TURN_COLUMNS))})"
_TURN_READ = ("model, message, prompt_ids, completion_ids, logprobs, loss_mask, completion_text, finish_reason, "
              "prompt_tokens, completion_tokens, cost_usd, latency_s, logprob_spec, trainable, purpose, unavailable, "
              "media")


def _bulk_settings(con: duckdb.DuckDBPyConnection) -> None:
    """A bulk write checkpoints at its commit instead of first copying its rows into the WAL.

    Every connection of the store checkpoints when it closes (the file is released between
    writes, and a reader must not replay a WAL), so a big transaction's rows would be written
    twice: to the WAL at commit, then into the table's blocks on close. A commit whose WAL would
    exceed ``checkpoint_threshold`` skips the WAL and checkpoints instead (DuckDB's automatic
    checkpoint); with the threshold at 0 that is every bulk commit. Durability is the same: the
    commit returns once the checkpoint has been written.
    """
    con.execute("SET checkpoint_threshold = '0b'")


def _prepare_call(call: ToolCall, result: ToolResult, secrets: list[str]) -> PreparedToolCall:
    return prepare_tool_call(call.id, call.name, call.function.arguments, result.content, result.error,
                             result.error_kind, result.latency_s, secrets)


@dataclass(slots=True)
class _PreparedStep:
    """A queued step made ready for the table rows before the transaction."""

    step: _Step
    episode: PreparedEpisode
    calls: list[tuple[PreparedToolCall, int | None]]
    media: list[str]  # hashes of the media its messages and turns reference


def _prepare_step(step: _Step, secrets: list[str], sink: MediaSink) -> _PreparedStep:
    episode = prepare_episode(step.messages, step.turns, secrets, sink)
    calls = [(_prepare_call(c, r, secrets), _turn_idx(i)) for c, r, i in step.tool_calls]
    return _PreparedStep(step, episode, calls, sorted(sink.take()))


def _turn_idx(value: Any) -> int | None:
    """A tool call's ``turn_idx`` as the INTEGER column takes it (None, the run's latest turn, for
    anything else, rather than an error that would fail the transaction)."""
    if isinstance(value, bool) or not isinstance(value, int) or not -2**31 <= value < 2**31:
        return None
    return value


def _redacted_label(value: str | None, secrets: list[str] | None = None) -> str | None:
    """A short label (graph name, tag) as stored: credential shapes go, as everywhere else."""
    return None if value is None else storable(redact_text(str(value), env_secrets=secrets))


def _redacted_tags(tags: Sequence[str] | None, secrets: list[str]) -> list[str]:
    if isinstance(tags, str):
        raise TypeError("tags must be a list of strings, not one string")
    return [label for t in tags or [] if (label := _redacted_label(t, secrets)) is not None]


def _take(counters: dict[str, int], run_id: str) -> int:
    idx = counters[run_id]
    counters[run_id] = idx + 1
    return idx


def _next_indices(con: duckdb.DuckDBPyConnection, table: str, run_ids: list[str]) -> dict[str, int]:
    """The next free ``idx`` of each run in ``table`` (0 for a run without rows), in one query."""
    out = {r: 0 for r in run_ids}
    if run_ids:
        for rid, top in con.execute(f"SELECT run_id, max(idx) FROM {table} WHERE list_contains(?, run_id) "
                                    "GROUP BY run_id", [run_ids]).fetchall():
            out[rid] = int(top) + 1
    return out


def _metric_entries(steps: Iterable[tuple[int, Mapping[str, float]]]) -> list[tuple[int, str, float]]:
    """Validated ``(step, name, value)`` rows; a bad entry is a clear error before anything is written."""
    out = []
    for item in steps:
        try:
            step, values = item
        except (TypeError, ValueError):
            raise TypeError(f"expected (step, {{name: value}}) pairs, got {item!r}") from None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not isinstance(values, Mapping):
            raise TypeError(f"metrics of step {step} must be a mapping name -> number, got {type(values).__name__}")
        for name, value in values.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"metric names must be non-empty strings, got {name!r} at step {step}")
            if isinstance(value, (str, bytes)) or value is None:
                raise TypeError(f"metric {name!r} at step {step} must be a number, got {value!r}")
            try:
                number = float(value)  # ints, numpy scalars, 0-d tensors
            except (TypeError, ValueError):
                raise TypeError(f"metric {name!r} at step {step} must be a number, got {value!r}") from None
            out.append((step, _redacted_label(name) or name, number))
    return out


def _new_id() -> str:
    import uuid

    return uuid.uuid4().hex


def _next_idx(con: duckdb.DuckDBPyConnection, table: str, run_id: str) -> int:
    row = con.execute(f"SELECT coalesce(max(idx) + 1, 0) FROM {table} WHERE run_id = ?", [run_id]).fetchone()
    return int(row[0])


def _insert_message(con: duckdb.DuckDBPyConnection, run_id: str, idx: int, role: str, js: str) -> None:
    con.execute("INSERT INTO messages VALUES (?, ?, ?, ?)", [run_id, idx, role, js])


_SUMMARY_COLUMNS = [f for f in RunSummary.model_fields]


def _summaries(con: duckdb.DuckDBPyConnection, clause: str, params: list[Any]) -> list[RunSummary]:
    rows = con.execute(f"SELECT {', '.join(_SUMMARY_COLUMNS)} FROM runs {clause}", params).fetchall()
    out = []
    for row in rows:
        d = dict(zip(_SUMMARY_COLUMNS, row))
        for key in ("config", "outcome", "metadata"):
            d[key] = _loads(d[key])
        d["config"] = d["config"] or {}
        d["metadata"] = d["metadata"] or {}
        d["tags"] = d["tags"] or []
        out.append(RunSummary(**d))
    return out


def _resolve(con: duckdb.DuckDBPyConnection, prefix: str) -> str:
    if not prefix:
        raise RunNotFoundError("empty run id")
    if con.execute("SELECT 1 FROM runs WHERE id = ?", [prefix]).fetchone():
        return prefix
    rows = con.execute("SELECT id FROM runs WHERE starts_with(id, ?) LIMIT 6", [prefix]).fetchall()
    if not rows:
        raise RunNotFoundError(f"no run with id {prefix!r}")
    if len(rows) > 1:
        raise RunNotFoundError(f"run id prefix {prefix!r} is ambiguous: {', '.join(r[0] for r in rows[:5])} ...")
    return rows[0][0]


def _restored_column(values: Any, lookup: duckdb.DuckDBPyConnection) -> Any:
    """A string column of message JSON with its media references replaced by the payloads."""
    import pyarrow as pa

    texts = values.to_pylist()
    hashes = referenced_hashes(texts)
    if hashes:
        restore = Restorer(fetch_media(lookup, hashes))
        texts = [restore(t) if t is not None else None for t in texts]
    return pa.array(texts, type=pa.string())


def _export_restored(con: duckdb.DuckDBPyConnection, table: str, column: str, path: Path,
                     lookup: duckdb.DuckDBPyConnection) -> None:
    """``table`` as Parquet, one record batch at a time, ``column`` with media restored."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    reader = con.sql(f"SELECT * FROM {table} ORDER BY ALL").to_arrow_reader(20_000)
    writer = None
    try:  # the reader is closed here, never left to keep the database open past the store's lock
        for batch in reader:
            columns = {name: batch.column(name) for name in batch.schema.names}
            columns[column] = _restored_column(columns[column], lookup)
            t = pa.table(columns)
            if writer is None:
                writer = pq.ParquetWriter(str(path), t.schema)
            writer.write_table(t)
        if writer is None:
            empty = {name: pa.array([], type=f.type) for name, f in zip(reader.schema.names, reader.schema)}
            empty[column] = pa.array([], type=pa.string())
            pq.write_table(pa.table(empty), str(path))
    finally:
        reader.close()
        if writer is not None:
            writer.close()


def _export_turns(con: duckdb.DuckDBPyConnection, path: Path, lookup: duckdb.DuckDBPyConnection | None = None) -> None:
    """``turns`` as Parquet with ``prompt_ids``/``completion_ids``/``logprobs``/``loss_mask`` as
    list columns (what a Parquet reader expects), one record batch at a time; with ``lookup``,
    ``message`` has its media restored."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    reader = con.sql("SELECT * FROM turns ORDER BY ALL").to_arrow_reader(20_000)
    writer = None
    try:  # the reader is closed here, never left to keep the database open past the store's lock
        for batch in reader:
            columns = {name: batch.column(name) for name in batch.schema.names}
            columns.update(turn_arrays_to_lists(columns))
            if lookup is not None:
                columns["message"] = _restored_column(columns["message"], lookup)
            table = pa.table(columns)
            if writer is None:
                writer = pq.ParquetWriter(str(path), table.schema)
            writer.write_table(table)
        if writer is None:  # no turns: an empty file with the list schema
            empty = {name: pa.array([], type=f.type) for name, f in zip(reader.schema.names, reader.schema)}
            empty.update(turn_arrays_to_lists(empty))
            if lookup is not None:
                empty["message"] = pa.array([], type=pa.string())
            pq.write_table(pa.table(empty), str(path))
    finally:
        reader.close()
        if writer is not None:
            writer.close()


_MESSAGES = TypeAdapter(list[Message])


def _messages_from_json(rows: list[str]) -> list[Any]:
    """Stored message JSON back to typed messages: one validation in pydantic-core per run."""
    return _MESSAGES.validate_json("[" + ",".join(rows) + "]") if rows else []


def _check_media_mode(media: str) -> None:
    if media not in ("inline", "refs"):
        raise ValueError(f"media must be 'inline' (parts as recorded) or 'refs' (references, no bytes), got {media!r}")


def _restorer(con: duckdb.DuckDBPyConnection, messages: Iterable[str], turn_rows: list[tuple[Any, ...]],
              message_column: int) -> Restorer | None:
    """A restorer holding the bytes these rows reference (one query), or None when they reference none."""
    hashes = referenced_hashes(messages)
    hashes |= referenced_hashes(r[message_column] for r in turn_rows)
    return Restorer(fetch_media(con, hashes)) if hashes else None


def _turn_from_row(row: tuple[Any, ...], messages: Mapping[str, Any] | None = None,
                   restore: Callable[[str], str] | None = None) -> Turn:
    """A stored turn as a :class:`Turn`.

    The row was written from a validated ``Turn``, so the turn is constructed without
    re-validating every token id (that was most of the cost of reading trajectories back); the
    arrays are decoded from their BLOBs (:mod:`closedloop.store.codec`) in C. ``messages``: the
    run's parsed messages by their stored JSON; a turn's message is nearly always one of them
    (stored from the same object), and then it is that object again, as it was when recorded,
    instead of a second parse.
    """
    (model, message, prompt_ids, completion_ids, logprobs, loss_mask, completion_text, finish_reason,
     prompt_tokens, completion_tokens, cost, latency, spec, trainable, purpose, unavailable, media) = row
    prompt_ids, completion_ids, logprobs, loss_mask = decode_turn_arrays(prompt_ids, completion_ids, logprobs,
                                                                         loss_mask)
    parsed = messages.get(message) if messages is not None else None
    if not isinstance(parsed, AssistantMessage):
        parsed = AssistantMessage.model_validate_json(restore(message) if restore is not None else message)
    return Turn.model_construct(
        message=parsed, model=model or "", prompt_ids=prompt_ids,
        completion_ids=completion_ids, logprobs=logprobs, loss_mask=loss_mask,
        logprob_spec=LogprobSpec.model_validate_json(spec) if spec else None,
        completion_text=completion_text, finish_reason=finish_reason,
        usage=Usage.model_construct(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cost_usd=cost),
        latency_s=latency, trainable=True if trainable is None else bool(trainable),
        purpose=purpose or "policy", unavailable=_loads(unavailable) or {},
        media=[MediaRef.model_validate(r) for r in _loads(media)] if media else [])
