"""Every run of an agent graph (interactive, evaluation episode, training rollout) in one DuckDB file.

DuckDB lets one process at a time open a file for writing, so the store never holds the file
between operations: each logical write opens a connection, runs inside BEGIN/COMMIT and closes.
Another process (``closedloop runs list`` next to a running eval) then gets its turn between
writes; a connection that finds the file locked retries with backoff until ``lock_timeout_s``.
A crash mid-write loses only the uncommitted transaction, never leaves half of one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time
import traceback
import warnings
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import duckdb
from pydantic import BaseModel

import closedloop
from closedloop.config import default_store_path
from closedloop.messages import AssistantMessage, ToolCall, Trajectory, Turn, Usage, _Message, parse_messages
from closedloop.store import pricing
from closedloop.store.process import hostname, pid_alive, process_start
from closedloop.store.records import (TERMINAL_STATUSES, RunRecord, RunSummary, ToolCallRecord, utcnow)
from closedloop.store.redact import _env_secrets, redact, redact_arguments, redact_message, redact_text
from closedloop.store.schema import TABLES, migrate
from closedloop.tool import ToolResult

__all__ = ["RunStore", "ActiveRun", "RunNotFoundError", "RunStateError", "StoreBusyError"]

T = TypeVar("T")
_MAX_ERROR_CHARS = 20_000


class RunNotFoundError(KeyError):
    """No run with that id (or id prefix)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RunStateError(RuntimeError):
    """The run is not in a state that allows the operation (e.g. logging to a finished run)."""


class StoreBusyError(RuntimeError):
    """Another process held the store's lock for longer than ``lock_timeout_s``."""


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
    return json.loads(json.dumps(value, default=str))


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


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
    has no cost; the default uses :mod:`closedloop.store.pricing`.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, lock_timeout_s: float = 15.0,
                 price_fn: pricing.PriceFn | None = None, detect_killed: bool = True) -> None:
        if lock_timeout_s < 0:
            raise ValueError("lock_timeout_s must be >= 0")
        self.lock_timeout_s = lock_timeout_s
        self.price_fn = price_fn or pricing.cost_usd
        self.detect_killed = detect_killed
        self._memory: duckdb.DuckDBPyConnection | None = None
        if str(path) == ":memory:":
            self.path: Path | str = ":memory:"
            self._memory = duckdb.connect(":memory:")
        else:
            self.path = Path(path).expanduser() if path is not None else default_store_path()
            if self.path.exists() and self.path.is_dir():
                raise ValueError(f"run store path {self.path} is a directory; give a file such as runs.duckdb")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tx(self._reap, before=migrate)  # "on open": a dead writer's runs show as killed at once

    def __repr__(self) -> str:
        return f"RunStore({str(self.path)!r})"

    # ------------------------------------------------------------------ connections

    @contextmanager
    def _connect(self, deadline: float | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
        if self._memory is not None:
            con = self._memory.cursor()
        else:
            deadline = deadline if deadline is not None else time.monotonic() + self.lock_timeout_s
            delay = 0.005
            while True:
                try:
                    con = duckdb.connect(str(self.path))
                    break
                except duckdb.IOException as e:
                    if "lock" not in str(e).lower():
                        raise
                    if time.monotonic() >= deadline:
                        raise StoreBusyError(f"run store {self.path} stayed locked for {self.lock_timeout_s:g} s: {e}") from e
                    time.sleep(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 0.2)
        try:
            yield con
        finally:
            con.close()

    def _tx(self, fn: Callable[[duckdb.DuckDBPyConnection], T],
            before: Callable[[duckdb.DuckDBPyConnection], Any] | None = None) -> T:
        """Run ``fn`` in one transaction; a write-write conflict with another thread is retried whole.

        ``before`` runs on the same connection outside the transaction (migrations manage their own).
        """
        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.005
        while True:
            try:
                with self._connect(deadline) as con:
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
                    raise StoreBusyError(f"run store {self.path}: transaction kept conflicting: {e}") from e
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.2)

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
        self._tx(lambda con: self._insert_run(con, run_id, kind, graph, model_spec, cfg, tags, meta, parent_id))
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
    def _require_running(con: duckdb.DuckDBPyConnection, run_id: str) -> str | None:
        """Raise unless the run exists and is running; returns its model_spec (to price turns)."""
        row = con.execute("SELECT status, model_spec FROM runs WHERE id = ?", [run_id]).fetchone()
        if row is None:
            raise RunNotFoundError(f"no run with id {run_id!r}")
        if row[0] != "running":
            raise RunStateError(f"run {run_id} is {row[0]}; only running runs can be written to")
        return row[1]

    # ------------------------------------------------------------------ children

    def log_messages(self, run_id: str, messages: Sequence[_Message | dict[str, Any]], *, replace: bool = False) -> int:
        """Append messages (or, with ``replace``, rewrite the run's message list); returns the count."""
        typed = parse_messages(list(messages))
        secrets = _env_secrets()
        rows = [(m.role, json.dumps(redact_message(m.model_dump(mode="json", exclude_none=True), secrets)))
                for m in typed]
        return self._tx(lambda con: self._write_messages(con, run_id, rows, replace))

    def _write_messages(self, con: duckdb.DuckDBPyConnection, run_id: str, rows: list[tuple[str, str]],
                        replace: bool) -> int:
        self._require_running(con, run_id)
        if replace:
            con.execute("DELETE FROM messages WHERE run_id = ?", [run_id])
        start = _next_idx(con, "messages", run_id)
        for i, (role, js) in enumerate(rows):
            _insert_message(con, run_id, start + i, role, js)
        con.execute("UPDATE runs SET updated_at = ? WHERE id = ?", [utcnow(), run_id])
        return len(rows)

    def log_turn(self, run_id: str, turn: Turn) -> int:
        """Record one model call token-exactly; adds its usage and cost to the run. Returns its index."""
        if not isinstance(turn, Turn):
            raise TypeError(f"log_turn takes a closedloop.messages.Turn, got {type(turn).__name__}")
        prepared = _prepare_turn(turn, _env_secrets())
        return self._tx(lambda con: self._write_turn(con, run_id, turn, prepared))

    def _write_turn(self, con: duckdb.DuckDBPyConnection, run_id: str, turn: Turn,
                    prepared: tuple[str, str | None, int, int]) -> int:
        message, text, prompt_tokens, completion_tokens = prepared
        model_spec = self._require_running(con, run_id)
        cost = turn.usage.cost_usd
        if cost is None:
            cost = self.price_fn(turn.model or model_spec or "", prompt_tokens, completion_tokens)
        idx = _next_idx(con, "turns", run_id)
        now = utcnow()
        con.execute("INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [run_id, idx, turn.model, message, turn.prompt_ids, turn.completion_ids,
                     turn.logprobs, turn.loss_mask, text, turn.finish_reason, prompt_tokens,
                     completion_tokens, cost, turn.latency_s, now])
        con.execute("UPDATE runs SET prompt_tokens = prompt_tokens + ?, completion_tokens = completion_tokens + ?, "
                    "cost_usd = CASE WHEN ?::DOUBLE IS NULL THEN cost_usd ELSE coalesce(cost_usd, 0) + ?::DOUBLE END, "
                    "updated_at = ? WHERE id = ?", [prompt_tokens, completion_tokens, cost, cost, now, run_id])
        return idx

    def log_tool_call(self, run_id: str, call: ToolCall, result: ToolResult, turn_idx: int | None = None) -> int:
        """Record a tool call and what it returned; ``turn_idx`` defaults to the latest turn."""
        secrets = _env_secrets()
        args = redact_arguments(call.function.arguments, env_secrets=secrets)
        content = redact_text(result.content, key_values=False, env_secrets=secrets)
        error = redact_text(result.error, env_secrets=secrets) if result.error else None

        def write(con: duckdb.DuckDBPyConnection) -> int:
            self._require_running(con, run_id)
            t_idx = turn_idx
            if t_idx is None:
                t_idx = con.execute("SELECT max(idx) FROM turns WHERE run_id = ?", [run_id]).fetchone()[0]
            idx = _next_idx(con, "tool_calls", run_id)
            now = utcnow()
            con.execute("INSERT INTO tool_calls VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [run_id, idx, t_idx, call.id, call.name, args, content, error, result.error_kind,
                         result.latency_s, now])
            con.execute("UPDATE runs SET updated_at = ? WHERE id = ?", [now, run_id])
            return idx

        return self._tx(write)

    def record_trajectory(self, trajectory: Trajectory, *, kind: str = "train", status: str = "completed",
                          graph: str | None = None, model_spec: str | None = None, config: Any = None,
                          tags: Sequence[str] | None = None, outcome: Mapping[str, Any] | None = None,
                          parent_id: str | None = None, started_at: datetime | None = None,
                          error: str | None = None) -> str:
        """Store a finished trajectory as one run (id = trajectory id) in a single transaction.

        One connection for the whole episode instead of one per turn: the cheap path for trainers
        that log hundreds of rollouts, and for evaluations that must never leave half an episode.
        ``started_at`` (naive UTC) records when the episode really began, so durations are real.
        """
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"status must be one of {TERMINAL_STATUSES}, got {status!r}")
        secrets = _env_secrets()
        cfg = redact(_jsonable(config) or {}, env_secrets=secrets)
        meta = redact(_jsonable(trajectory.metadata) or {}, env_secrets=secrets)
        rows = [(m.role, json.dumps(redact_message(m.model_dump(mode="json", exclude_none=True), secrets)))
                for m in trajectory.messages]
        turns = [(t, _prepare_turn(t, secrets)) for t in trajectory.turns]
        out = redact({"rewards": trajectory.rewards,
                      **({"step_rewards": trajectory.step_rewards} if trajectory.step_rewards else {}),
                      **(_jsonable(outcome) or {})}, keys=False, key_values=False, env_secrets=secrets)

        err = _format_error(error)

        def write(con: duckdb.DuckDBPyConnection) -> str:
            self._insert_run(con, trajectory.id, kind, graph, model_spec, cfg, tags, meta, parent_id)
            self._write_messages(con, trajectory.id, rows, False)
            for turn, prepared in turns:
                self._write_turn(con, trajectory.id, turn, prepared)
            self._write_finish(con, trajectory.id, status, out, err)
            if started_at is not None:
                con.execute("UPDATE runs SET started_at = ? WHERE id = ?", [started_at, trajectory.id])
            return trajectory.id

        return self._tx(write)

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

    def get_run(self, run_id: str) -> RunRecord:
        """The run with its messages, turns and tool calls; accepts a unique id prefix."""

        def read(con: duckdb.DuckDBPyConnection) -> RunRecord:
            self._reap(con)
            full = _resolve(con, run_id)
            summary = _summaries(con, "WHERE id = ?", [full])[0]
            msgs = [json.loads(r[0]) for r in con.execute(
                "SELECT json FROM messages WHERE run_id = ? ORDER BY idx", [full]).fetchall()]
            turns = [_turn_from_row(r) for r in con.execute(
                "SELECT model, message, prompt_ids, completion_ids, logprobs, loss_mask, completion_text, "
                "finish_reason, prompt_tokens, completion_tokens, cost_usd, latency_s FROM turns "
                "WHERE run_id = ? ORDER BY idx", [full]).fetchall()]
            cur = con.execute("SELECT idx, turn_idx, call_id, name, arguments, result, error, error_kind, latency_s "
                              "FROM tool_calls WHERE run_id = ? ORDER BY idx", [full])
            cols = [d[0] for d in cur.description]
            calls = [ToolCallRecord(**dict(zip(cols, r))) for r in cur.fetchall()]
            return RunRecord(**summary.model_dump(), messages=parse_messages(msgs), turns=turns, tool_calls=calls)

        return self._tx(read)

    def load_trajectory(self, run_id: str) -> Trajectory:
        return self.get_run(run_id).to_trajectory()

    def list_runs(self, limit: int | None = 50, status: str | None = None, graph: str | None = None,
                  kind: str | None = None, parent_id: str | None = None, tag: str | None = None) -> list[RunSummary]:
        """Newest first."""
        if limit is not None and limit < 0:
            raise ValueError("limit must be >= 0")
        where, params = [], []
        for column, value in (("status", status), ("graph", graph), ("kind", kind), ("parent_id", parent_id)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if tag is not None:
            where.append("list_contains(tags, ?)")
            params.append(tag)
        clause = ("WHERE " + " AND ".join(where) if where else "") + " ORDER BY started_at DESC, id"
        if limit is not None:
            clause += f" LIMIT {int(limit)}"

        def read(con: duckdb.DuckDBPyConnection) -> list[RunSummary]:
            self._reap(con)
            return _summaries(con, clause, params)

        return self._tx(read)

    def resolve_id(self, prefix: str) -> str:
        return self._tx(lambda con: _resolve(con, prefix))

    # ------------------------------------------------------------------ maintenance

    def reap_killed(self) -> list[str]:
        """Mark ``killed`` the running runs of this host whose process is gone; returns their ids.

        Their ``ended_at`` is the last write we saw, the closest we know to when they died.
        """
        return self._tx(self._reap)

    def _reap(self, con: duckdb.DuckDBPyConnection) -> list[str]:
        """Runs inside the caller's transaction, so listing a store costs one connection, not two."""
        if not self.detect_killed:
            return []
        host = hostname()
        rows = con.execute("SELECT id, pid, proc_start FROM runs WHERE status = 'running' AND hostname = ?",
                           [host]).fetchall()
        dead = [(rid, pid) for rid, pid, start in rows if not pid_alive(pid, start)]
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

        def write(con: duckdb.DuckDBPyConnection) -> int:
            self._reap(con)
            ids = [r[0] for r in con.execute("SELECT id FROM runs WHERE status <> 'running' AND "
                                             "coalesce(ended_at, updated_at) < ?", [cutoff]).fetchall()]
            if not ids:
                return 0
            for table in ("messages", "turns", "tool_calls"):
                con.execute(f"DELETE FROM {table} WHERE list_contains(?, run_id)", [ids])
            con.execute("DELETE FROM runs WHERE list_contains(?, id)", [ids])
            return len(ids)

        return self._tx(write)

    def export_parquet(self, directory: str | os.PathLike[str]) -> dict[str, Path]:
        """One Parquet file per table, written by DuckDB from one consistent snapshot."""
        out = Path(directory).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        paths = {t: (out / f"{t}.parquet").resolve() for t in TABLES}

        def write(con: duckdb.DuckDBPyConnection) -> dict[str, Path]:
            for table, path in paths.items():
                quoted = str(path).replace("'", "''")
                con.execute(f"COPY (SELECT * FROM {table} ORDER BY ALL) TO '{quoted}' (FORMAT parquet)")
            return paths

        return self._tx(write)

    def close(self) -> None:
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


def _new_id() -> str:
    import uuid

    return uuid.uuid4().hex


def _next_idx(con: duckdb.DuckDBPyConnection, table: str, run_id: str) -> int:
    row = con.execute(f"SELECT coalesce(max(idx) + 1, 0) FROM {table} WHERE run_id = ?", [run_id]).fetchone()
    return int(row[0])


def _prepare_turn(turn: Turn, secrets: list[str]) -> tuple[str, str | None, int, int]:
    """Redaction and token counts, done before the transaction so the lock is held briefly."""
    message = redact_message(turn.message.model_dump(mode="json", exclude_none=True), secrets)
    text = redact_text(turn.completion_text, key_values=False, env_secrets=secrets) if turn.completion_text else turn.completion_text
    return (json.dumps(message), text, turn.usage.prompt_tokens or len(turn.prompt_ids or []),
            turn.usage.completion_tokens or len(turn.completion_ids or []))


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


def _turn_from_row(row: tuple[Any, ...]) -> Turn:
    (model, message, prompt_ids, completion_ids, logprobs, loss_mask, completion_text, finish_reason,
     prompt_tokens, completion_tokens, cost, latency) = row
    return Turn(message=AssistantMessage(**json.loads(message)), model=model or "", prompt_ids=prompt_ids,
                completion_ids=completion_ids, logprobs=logprobs, loss_mask=loss_mask,
                completion_text=completion_text, finish_reason=finish_reason,
                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cost_usd=cost),
                latency_s=latency)
