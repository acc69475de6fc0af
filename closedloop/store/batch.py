"""Rows ready for the store, and many of them inserted with one statement per table.

Two costs dominate a naive writer: opening the DuckDB file (tens of ms, see ``store.py``) and one
``execute`` per row (a few hundred µs each once parameters, list columns and the catalog lookup are
counted). The bulk path pays neither per row: everything a run needs is prepared (redacted,
serialised, counted) in Python first, collected into columns, and handed to DuckDB as one Arrow
table per store table (``INSERT ... SELECT`` over a registered Arrow table is a vectorised copy).

``pyarrow`` is imported lazily; it is installed with ``datasets``, a core dependency.
"""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Sequence

import duckdb

from closedloop.messages import Turn, _Message
from closedloop.store.redact import might_hold_secret, redact_arguments, redact_message_json, redact_text
from closedloop.store.schema import MESSAGE_COLUMNS, METRIC_COLUMNS, TOOL_CALL_COLUMNS, TURN_COLUMNS

__all__ = ["PreparedTurn", "PreparedToolCall", "prepare_turn", "prepare_message", "prepare_episode",
           "prepare_tool_call", "turn_row", "RUN_COLUMNS", "Rows", "Pricer", "ensure_arrow"]

# The columns a new run row is written with (the rest keep their defaults).
RUN_COLUMNS = ("id", "kind", "graph", "model_spec", "config", "status", "pid", "hostname", "proc_start", "parent_id",
               "closedloop_version", "started_at", "updated_at", "ended_at", "outcome", "error", "prompt_tokens",
               "completion_tokens", "cost_usd", "tags", "metadata")


@dataclass(slots=True)
class PreparedTurn:
    """A turn as the ``turns`` table keeps it, before it has a run position or a price."""

    model: str
    message: str
    prompt_ids: list[int] | None
    completion_ids: list[int] | None
    logprobs: list[float] | None
    loss_mask: list[int] | None
    completion_text: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float | None  # the backend's own figure; None is priced by the store
    latency_s: float | None
    logprob_spec: str | None
    trainable: bool
    purpose: str
    unavailable: str | None


@dataclass(slots=True)
class PreparedToolCall:
    call_id: str | None
    name: str
    arguments: str
    result: str
    error: str | None
    error_kind: str | None
    latency_s: float | None


def _message_json(message: _Message, secrets: list[str]) -> str:
    """Redacted JSON of a message; pydantic's own serialiser (3x faster than dump + json.dumps) when
    the text cannot hold a secret, the full redaction otherwise."""
    text = message.model_dump_json(exclude_none=True)
    if not might_hold_secret(text, secrets):
        return text
    return redact_message_json(message.model_dump(mode="json", exclude_none=True), secrets)


def prepare_message(message: _Message, secrets: list[str]) -> tuple[str, str]:
    """(role, redacted JSON)."""
    return message.role, _message_json(message, secrets)


def prepare_turn(turn: Turn, secrets: list[str], message_json: str | None = None) -> PreparedTurn:
    """Redaction and token counts, done before any transaction so the file lock is held briefly.

    ``message_json``: the turn's message already prepared (it is usually also in the message
    list of its trajectory), so it is not serialised and redacted twice.
    """
    if message_json is None:
        message_json = _message_json(turn.message, secrets)
    text = turn.completion_text
    if text and might_hold_secret(text, secrets):
        text = redact_text(text, key_values=False, env_secrets=secrets)
    return PreparedTurn(
        model=turn.model, message=message_json, prompt_ids=turn.prompt_ids, completion_ids=turn.completion_ids,
        logprobs=turn.logprobs, loss_mask=turn.loss_mask, completion_text=text, finish_reason=turn.finish_reason,
        prompt_tokens=turn.usage.prompt_tokens or len(turn.prompt_ids or []),
        completion_tokens=turn.usage.completion_tokens or len(turn.completion_ids or []),
        cost_usd=turn.usage.cost_usd, latency_s=turn.latency_s,
        logprob_spec=turn.logprob_spec.model_dump_json() if turn.logprob_spec is not None else None,
        trainable=turn.trainable, purpose=turn.purpose,
        unavailable=json.dumps(turn.unavailable) if turn.unavailable else None)


def prepare_episode(messages: Sequence[_Message], turns: Sequence[Turn],
                    secrets: list[str]) -> tuple[list[tuple[str, str]], list[PreparedTurn]]:
    """Messages and turns of one episode; a turn's message that is also in ``messages`` (the same
    object, as graphs and environments produce them) is serialised once."""
    prepared_messages = [prepare_message(m, secrets) for m in messages]
    by_id = {id(m): js for m, (_, js) in zip(messages, prepared_messages)}
    return prepared_messages, [prepare_turn(t, secrets, by_id.get(id(t.message))) for t in turns]


def prepare_tool_call(call_id: str | None, name: str, arguments: str, content: str, error: str | None,
                      error_kind: str | None, latency_s: float | None, secrets: list[str]) -> PreparedToolCall:
    return PreparedToolCall(call_id=call_id, name=name, arguments=redact_arguments(arguments, env_secrets=secrets),
                            result=redact_text(content, key_values=False, env_secrets=secrets),
                            error=redact_text(error, env_secrets=secrets) if error else None,
                            error_kind=error_kind, latency_s=latency_s)


class Pricer:
    """``price_fn`` for one batch. The default price function re-reads the price table (and the
    environment) on every call; within one batch the table cannot change, so its lookup per model
    name is done once. A custom ``price_fn`` is called per turn, as documented."""

    def __init__(self, price_fn: Callable[[str, int, int], float | None]) -> None:
        from closedloop.store import pricing

        self._fn = price_fn
        self._default = price_fn is pricing.cost_usd
        self._prices: dict[str, Any] = {}
        self._lookup = pricing.price_for

    def __call__(self, model: str, prompt_tokens: int, completion_tokens: int) -> float | None:
        if not self._default:
            return self._fn(model, prompt_tokens, completion_tokens)
        if model not in self._prices:
            self._prices[model] = self._lookup(model)
        price = self._prices[model]
        return None if price is None else price.cost(prompt_tokens, completion_tokens)


def turn_row(run_id: str, idx: int, t: PreparedTurn, cost: float | None, now: datetime) -> list[Any]:
    """One ``turns`` row in :data:`TURN_COLUMNS` order."""
    return [run_id, idx, t.model, t.message, t.prompt_ids, t.completion_ids, t.logprobs, t.loss_mask,
            t.completion_text, t.finish_reason, t.prompt_tokens, t.completion_tokens, cost, t.latency_s, now,
            t.logprob_spec, t.trainable, t.purpose, t.unavailable]


_ARROW_READY = False
# Below this many rows a table is inserted with ``executemany``: cheaper than building an Arrow
# table, and it needs no pyarrow at all (see :func:`ensure_arrow`).
SMALL_BATCH = 32


def ensure_arrow() -> bool:
    """Import pyarrow and what its first conversion imports (pandas, through its shim); True if ready.

    A first import during interpreter exit fails ("can't register atexit after shutdown"), so the
    queue's final flush must not be the first user: the store warms this up on the writer thread
    when it starts and before bulk writes; until it is ready, inserts take the ``executemany`` path.
    """
    global _ARROW_READY
    if not _ARROW_READY:
        try:
            import pyarrow as pa

            pa.array([0], type=pa.int32())
            _arrow_types()
        except (ImportError, RuntimeError):
            return False
        _ARROW_READY = True
    return True


@functools.lru_cache(maxsize=1)
def _arrow_types() -> dict[str, dict[str, Any]]:
    import pyarrow as pa

    ts = pa.timestamp("us")
    return {
        "runs": {"id": pa.string(), "kind": pa.string(), "graph": pa.string(), "model_spec": pa.string(),
                 "config": pa.string(), "status": pa.string(), "pid": pa.int32(), "hostname": pa.string(),
                 "proc_start": pa.int64(), "parent_id": pa.string(), "closedloop_version": pa.string(),
                 "started_at": ts, "updated_at": ts, "ended_at": ts, "outcome": pa.string(), "error": pa.string(),
                 "prompt_tokens": pa.int64(), "completion_tokens": pa.int64(), "cost_usd": pa.float64(),
                 "tags": pa.list_(pa.string()), "metadata": pa.string()},
        "messages": {"run_id": pa.string(), "idx": pa.int32(), "role": pa.string(), "json": pa.string()},
        "turns": {"run_id": pa.string(), "idx": pa.int32(), "model": pa.string(), "message": pa.string(),
                  "prompt_ids": pa.list_(pa.int32()), "completion_ids": pa.list_(pa.int32()),
                  "logprobs": pa.list_(pa.float64()), "loss_mask": pa.list_(pa.int8()),
                  "completion_text": pa.string(), "finish_reason": pa.string(), "prompt_tokens": pa.int64(),
                  "completion_tokens": pa.int64(), "cost_usd": pa.float64(), "latency_s": pa.float64(),
                  "created_at": ts, "logprob_spec": pa.string(), "trainable": pa.bool_(), "purpose": pa.string(),
                  "unavailable": pa.string()},
        "tool_calls": {"run_id": pa.string(), "idx": pa.int32(), "turn_idx": pa.int32(), "call_id": pa.string(),
                       "name": pa.string(), "arguments": pa.string(), "result": pa.string(), "error": pa.string(),
                       "error_kind": pa.string(), "latency_s": pa.float64(), "created_at": ts},
        "metrics": {"run_id": pa.string(), "step": pa.int64(), "name": pa.string(), "value": pa.float64(),
                    "created_at": ts},
    }


_COLUMNS = {"runs": RUN_COLUMNS, "messages": MESSAGE_COLUMNS, "turns": TURN_COLUMNS, "tool_calls": TOOL_CALL_COLUMNS,
            "metrics": METRIC_COLUMNS}


class Rows:
    """Rows for several tables, inserted by :meth:`insert` in one statement per table."""

    def __init__(self) -> None:
        self.tables: dict[str, list[Sequence[Any]]] = {name: [] for name in _COLUMNS}

    def add(self, table: str, values: Sequence[Any]) -> None:
        """One row, values in the table's column order (see :mod:`closedloop.store.schema`)."""
        if len(values) != len(_COLUMNS[table]):
            raise ValueError(f"{table} rows have {len(_COLUMNS[table])} values, got {len(values)}")
        self.tables[table].append(values)

    def count(self, table: str) -> int:
        return len(self.tables[table])

    def drop_run(self, table: str, run_id: str) -> None:
        """Forget this batch's rows of one run (``log_messages(replace=True)`` queued after appends)."""
        self.tables[table] = [r for r in self.tables[table] if r[0] != run_id]

    def insert(self, con: duckdb.DuckDBPyConnection) -> None:
        for table, rows in self.tables.items():
            if not rows:
                continue
            names = ", ".join(_COLUMNS[table])
            if len(rows) < SMALL_BATCH or not _ARROW_READY:
                con.executemany(f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(_COLUMNS[table]))})",
                                [list(r) for r in rows])
                continue
            import pyarrow as pa

            types = _arrow_types()
            columns = list(zip(*rows))  # column-major, in C
            arrow = pa.table({name: _to_arrow(values, types[table][name])
                              for name, values in zip(_COLUMNS[table], columns)})
            view = f"_closedloop_batch_{table}"
            _finish_pending(con)
            con.register(view, arrow)
            try:
                con.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM {view}")
            finally:
                _finish_pending(con)
                con.unregister(view)


_INT8_NONNEGATIVE = bytes(range(128))


def _to_arrow(values: Sequence[Any], arrow_type: Any) -> Any:
    """``pa.array(values, arrow_type)``; a loss-mask column (lists of 0/1) goes through ``bytes``,
    2x faster than pyarrow's generic conversion of Python ints."""
    import pyarrow as pa

    if arrow_type == pa.list_(pa.int8()) and all(v is not None for v in values):
        try:
            flat = b"".join(map(bytes, values))  # ValueError for anything outside 0..255
        except (ValueError, TypeError):
            return pa.array(values, type=arrow_type)
        if not flat.translate(None, _INT8_NONNEGATIVE):  # every byte fits int8
            offsets = pa.array(list(itertools.accumulate(map(len, values), initial=0)), type=pa.int32())
            return pa.ListArray.from_arrays(offsets, pa.Array.from_buffers(pa.int8(), len(flat),
                                                                           [None, pa.py_buffer(flat)]))
    return pa.array(values, type=arrow_type)


def _finish_pending(con: duckdb.DuckDBPyConnection) -> None:
    """DuckDB >= 2 refuses ``register`` while an ``execute`` result is unread; older ones lack ``complete``."""
    complete = getattr(con, "complete", None)
    if complete is not None:
        complete()
