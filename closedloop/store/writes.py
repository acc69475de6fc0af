"""What a running run adds, one synchronous write at a time: messages, turns, tool calls, metrics.

Each ``write_*`` runs inside the caller's transaction and checks first that the run is running
(:func:`~closedloop.store.runs.require_running`); what it writes was prepared (redacted, encoded)
before the transaction by :mod:`closedloop.store.batch`. The helpers that number rows
(:func:`next_indices`, :func:`take`) and price turns (:func:`price`) serve the queued writer too
(:mod:`closedloop.store.queued`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import duckdb

from closedloop.messages import ToolCall
from closedloop.store.batch import PreparedToolCall, PreparedTurn, Rows, prepare_tool_call, turn_row, without_token_ids
from closedloop.store.media import MediaSink, write_media
from closedloop.store.pricing import PriceFn
from closedloop.store.records import utcnow
from closedloop.store.runs import require_running
from closedloop.store.schema import TURN_COLUMNS
from closedloop.store.values import redacted_label
from closedloop.tool import ToolResult

__all__ = ["write_messages", "write_turn", "write_tool_call", "write_metrics", "metric_entries", "prepare_call",
           "tool_call_turn_idx", "price", "next_indices", "take"]

_INSERT_TURN = f"INSERT INTO turns ({', '.join(TURN_COLUMNS)}) VALUES ({', '.join('?' * len(TURN_COLUMNS))})"


def write_messages(con: duckdb.DuckDBPyConnection, run_id: str, rows: list[tuple[str, str, bool]], replace: bool,
                   sink: MediaSink | None = None) -> int:
    """Append ``(role, json, redacted)`` rows (or, with ``replace``, rewrite the run's messages)."""
    require_running(con, run_id)
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


def price(turn: PreparedTurn, model_spec: str | None, price_fn: PriceFn) -> float | None:
    """The turn's cost: the backend's own figure, else ``price_fn`` of its model (or the run's)."""
    if turn.cost_usd is not None:
        return turn.cost_usd
    return price_fn(turn.model or model_spec or "", turn.prompt_tokens, turn.completion_tokens)


def write_turn(con: duckdb.DuckDBPyConnection, run_id: str, prepared: PreparedTurn, price_fn: PriceFn,
               sink: MediaSink | None = None) -> int:
    """One turn at the run's next index, its usage and cost added to the run's totals."""
    model_spec, tainted = require_running(con, run_id)
    if tainted:  # its prompt holds the conversation, from which a credential was redacted
        prepared = without_token_ids(prepared)
    if sink is not None and sink.blobs:
        write_media(con, sink, [(run_id, h) for h in sink.blobs], utcnow())
    cost = price(prepared, model_spec, price_fn)
    idx = _next_idx(con, "turns", run_id)
    now = utcnow()
    con.execute(_INSERT_TURN, turn_row(run_id, idx, prepared, cost, now))
    con.execute("UPDATE runs SET prompt_tokens = prompt_tokens + ?, completion_tokens = completion_tokens + ?, "
                "cost_usd = CASE WHEN ?::DOUBLE IS NULL THEN cost_usd ELSE coalesce(cost_usd, 0) + ?::DOUBLE END, "
                "updated_at = ?, secrets_redacted = secrets_redacted OR ? WHERE id = ?",
                [prepared.prompt_tokens, prepared.completion_tokens, cost, cost, now, prepared.redacted, run_id])
    return idx


def prepare_call(call: ToolCall, result: ToolResult, secrets: list[str]) -> PreparedToolCall:
    return prepare_tool_call(call.id, call.name, call.function.arguments, result.content, result.error,
                             result.error_kind, result.latency_s, secrets)


def tool_call_turn_idx(value: Any) -> int | None:
    """A tool call's ``turn_idx`` as the INTEGER column takes it (None, the run's latest turn, for
    anything else, rather than an error that would fail the transaction)."""
    if isinstance(value, bool) or not isinstance(value, int) or not -2**31 <= value < 2**31:
        return None
    return value


def write_tool_call(con: duckdb.DuckDBPyConnection, run_id: str, p: PreparedToolCall, turn_idx: int | None) -> int:
    """One tool call at the run's next index; ``turn_idx=None`` is the run's latest turn."""
    require_running(con, run_id)
    t_idx = tool_call_turn_idx(turn_idx)
    if t_idx is None:
        t_idx = _one(con, "SELECT max(idx) FROM turns WHERE run_id = ?", [run_id])
    idx = _next_idx(con, "tool_calls", run_id)
    now = utcnow()
    con.execute("INSERT INTO tool_calls VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [run_id, idx, t_idx, p.call_id, p.name, p.arguments, p.result, p.error, p.error_kind, p.latency_s,
                 now])
    con.execute("UPDATE runs SET updated_at = ? WHERE id = ?", [now, run_id])
    return idx


def metric_entries(steps: Iterable[Any]) -> list[tuple[int, str, float]]:
    """Validated ``(step, name, value)`` rows from ``(step, {name: value})`` pairs (as callers give
    them, so anything); a bad entry is a clear error before anything is written."""
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
            out.append((step, redacted_label(name) or name, number))
    return out


def write_metrics(con: duckdb.DuckDBPyConnection, run_id: str, entries: list[tuple[int, str, float]]) -> int:
    """Metric rows of :func:`metric_entries`; a (run, step, name) logged again replaces its value."""
    require_running(con, run_id)
    now = utcnow()
    rows = Rows()
    for step_no, name, value in entries:
        rows.add("metrics", (run_id, step_no, name, value, now))
    rows.insert(con)
    con.execute("UPDATE runs SET updated_at = ? WHERE id = ?", [now, run_id])
    return len(entries)


def take(counters: dict[str, int], run_id: str) -> int:
    """The run's next index from ``counters``, advanced."""
    idx = counters[run_id]
    counters[run_id] = idx + 1
    return idx


def next_indices(con: duckdb.DuckDBPyConnection, table: str, run_ids: list[str]) -> dict[str, int]:
    """The next free ``idx`` of each run in ``table`` (0 for a run without rows), in one query."""
    out = {r: 0 for r in run_ids}
    if run_ids:
        for rid, top in con.execute(f"SELECT run_id, max(idx) FROM {table} WHERE list_contains(?, run_id) "
                                    "GROUP BY run_id", [run_ids]).fetchall():
            out[rid] = int(top) + 1
    return out


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> Any:
    """The first column of the one row an aggregate query returns."""
    row = con.execute(sql, params).fetchone()
    assert row is not None  # an aggregate without GROUP BY always returns a row
    return row[0]


def _next_idx(con: duckdb.DuckDBPyConnection, table: str, run_id: str) -> int:
    return int(_one(con, f"SELECT coalesce(max(idx) + 1, 0) FROM {table} WHERE run_id = ?", [run_id]))


def _insert_message(con: duckdb.DuckDBPyConnection, run_id: str, idx: int, role: str, js: str) -> None:
    con.execute("INSERT INTO messages VALUES (?, ?, ?, ?)", [run_id, idx, role, js])
