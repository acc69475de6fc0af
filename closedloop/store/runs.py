"""A run's life in the ``runs`` table: started by this process, finished with a status, reopened to
resume, or marked ``killed`` when the process that owned it is gone.

Each function runs inside the caller's transaction (:meth:`StoreFile.transaction
<closedloop.store.connection.StoreFile.transaction>`); the values are prepared (validated,
redacted) before it, by :func:`new_run` and :func:`finish_values`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import duckdb

import closedloop
from closedloop.redact import env_secrets, redact, redact_spec
from closedloop.store.errors import RunNotFoundError, RunStateError
from closedloop.store.process import hostname, pid_alive, process_start
from closedloop.store.records import TERMINAL_STATUSES, utcnow
from closedloop.store.values import dumps, format_error, jsonable, new_id, redacted_label, redacted_tags

__all__ = ["NewRun", "check_kind", "check_terminal", "new_run", "insert_run", "finish_values", "write_finish",
           "require_running", "reopen", "dead_runs", "reap"]


def check_kind(kind: Any) -> None:
    if not kind or not isinstance(kind, str):
        raise ValueError("kind must be a non-empty string such as 'run', 'eval' or 'train'")


def check_terminal(status: str) -> None:
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"status must be one of {TERMINAL_STATUSES}, got {status!r}")


@dataclass(frozen=True, slots=True)
class NewRun:
    """A run row as :func:`insert_run` writes it: every value already redacted."""

    id: str
    kind: str
    graph: str | None
    model_spec: str | None
    config: dict[str, Any]
    tags: list[str]
    metadata: dict[str, Any]
    parent_id: str | None


def new_run(*, kind: str, graph: str | None, model_spec: str | None, config: Any, tags: Sequence[str] | None,
            metadata: Mapping[str, Any] | None, parent_id: str | None, run_id: str | None) -> NewRun:
    check_kind(kind)
    secrets = env_secrets()
    cfg = redact(jsonable(config) or {}, env_secrets=secrets)
    meta = redact(jsonable(metadata) or {}, env_secrets=secrets)
    if not isinstance(cfg, dict) or not isinstance(meta, dict):
        raise TypeError("config and metadata must be mappings (dict, pydantic model or dataclass)")
    return NewRun(id=run_id or new_id(), kind=kind, graph=redacted_label(graph, secrets),
                  model_spec=redact_spec(model_spec),  # ``openai:m@http://user:key@host`` never reaches the file
                  config=cfg, tags=redacted_tags(tags, secrets), metadata=meta, parent_id=parent_id)


def insert_run(con: duckdb.DuckDBPyConnection, run: NewRun) -> None:
    """The run, ``running`` and owned by this process (pid, host and the process's start time)."""
    if con.execute("SELECT 1 FROM runs WHERE id = ?", [run.id]).fetchone():
        raise RunStateError(f"a run with id {run.id!r} already exists")
    pid = os.getpid()
    now = utcnow()
    con.execute("INSERT INTO runs (id, kind, graph, model_spec, config, status, pid, hostname, proc_start, "
                "parent_id, closedloop_version, started_at, updated_at, tags, metadata) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [run.id, run.kind, run.graph, run.model_spec, dumps(run.config), "running", pid, hostname(),
                 process_start(pid), run.parent_id, closedloop.__version__, now, now, run.tags, dumps(run.metadata)])


def finish_values(status: str, outcome: Mapping[str, Any] | None,
                  error: BaseException | str | None) -> tuple[dict[str, Any] | None, str | None]:
    """The outcome and error of a finishing run as stored (validated and redacted)."""
    check_terminal(status)
    out = redact(jsonable(outcome), keys=False, key_values=False) if outcome is not None else None
    if out is not None and not isinstance(out, dict):
        raise TypeError("outcome must be a mapping, e.g. {'answer': ..., 'rewards': {...}}")
    return out, format_error(error)


def write_finish(con: duckdb.DuckDBPyConnection, run_id: str, status: str, out: dict[str, Any] | None,
                 err: str | None) -> None:
    require_running(con, run_id)
    now = utcnow()
    con.execute("UPDATE runs SET status = ?, outcome = ?, error = ?, ended_at = ?, updated_at = ? WHERE id = ?",
                [status, dumps(out), err, now, now, run_id])


def require_running(con: duckdb.DuckDBPyConnection, run_id: str) -> tuple[str | None, bool]:
    """Raise unless the run exists and is running; returns its model_spec (to price turns) and
    whether a credential was redacted from its texts already (its turns then keep no token ids)."""
    row = con.execute("SELECT status, model_spec, secrets_redacted FROM runs WHERE id = ?", [run_id]).fetchone()
    if row is None:
        raise RunNotFoundError(f"no run with id {run_id!r}")
    if row[0] != "running":
        raise RunStateError(f"run {run_id} is {row[0]}; only running runs can be written to")
    return row[1], bool(row[2])


def reopen(con: duckdb.DuckDBPyConnection, run_id: str, config: Any, *, detect_killed: bool) -> None:
    """Make a finished run ``running`` again, owned by this process; its metadata counts the
    attempts and keeps the earlier statuses. ``config`` (already redacted) replaces the old one."""
    reap(con, detect_killed=detect_killed)
    row = con.execute("SELECT status, pid, hostname, metadata, config FROM runs WHERE id = ?", [run_id]).fetchone()
    if row is None:
        raise RunStateError(f"no run {run_id}")
    status, old_pid, host, meta, old_cfg = row
    if status == "running":
        raise RunStateError(f"run {run_id} is still running (pid {old_pid} on {host}); stop it first")
    meta = json.loads(meta) if isinstance(meta, str) else (meta or {})
    meta["attempts"] = int(meta.get("attempts", 1)) + 1
    meta.setdefault("previous_status", []).append(status)
    new_cfg = json.dumps(config) if config is not None else old_cfg
    pid = os.getpid()
    con.execute("UPDATE runs SET status = 'running', pid = ?, hostname = ?, proc_start = ?, ended_at = NULL, "
                "error = NULL, outcome = NULL, config = ?, metadata = ?, updated_at = ? WHERE id = ?",
                [pid, hostname(), process_start(pid), new_cfg, json.dumps(meta), utcnow(), run_id])


def dead_runs(con: duckdb.DuckDBPyConnection, *, detect_killed: bool) -> list[tuple[str, int]]:
    """(id, pid) of this host's running runs whose process is gone (a read)."""
    if not detect_killed:
        return []
    rows = con.execute("SELECT id, pid, proc_start FROM runs WHERE status = 'running' AND hostname = ?",
                       [hostname()]).fetchall()
    return [(rid, pid) for rid, pid, start in rows if not pid_alive(pid, start)]


def reap(con: duckdb.DuckDBPyConnection, *, detect_killed: bool) -> list[str]:
    """Mark ``killed`` the runs of :func:`dead_runs`, in the caller's (write) transaction, so a write
    and the reaping share one connection. Their ``ended_at`` is the last write seen, the closest
    known to when they died."""
    dead = dead_runs(con, detect_killed=detect_killed)
    host = hostname()
    for rid, pid in dead:
        con.execute("UPDATE runs SET status = 'killed', ended_at = updated_at, error = ? "
                    "WHERE id = ? AND status = 'running'",
                    [f"process {pid} on {host} exited without finishing the run "
                     f"(detected {utcnow():%Y-%m-%d %H:%M:%S} UTC)", rid])
    return [rid for rid, _ in dead]
