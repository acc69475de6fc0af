"""Rows ready for the store, and many of them inserted with one statement per table.

Two costs dominate a naive writer: opening the DuckDB file (tens of ms, see ``store.py``) and one
``execute`` per row (a few hundred µs each once parameters, list columns and the catalog lookup are
counted). The bulk path pays neither per row: everything a run needs is prepared (redacted,
serialised, counted) in Python first, collected into columns, and handed to DuckDB as one Arrow
table per store table (``INSERT ... SELECT`` over a registered Arrow table is a vectorised copy).

``pyarrow`` is imported lazily; it is installed with ``datasets``, a core dependency.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterator, Sequence

import duckdb

from closedloop.messages import LogprobSpec, Turn, _Message
from closedloop.store.codec import encode_floats, encode_ids, encode_mask
from closedloop.store.media import MediaSink, externalize_json, might_hold_media, might_hold_refs
from closedloop.store.redact import might_hold_secret, redact, redact_arguments, redact_message_json, redact_text
from closedloop.store.schema import MESSAGE_COLUMNS, METRIC_COLUMNS, TOOL_CALL_COLUMNS, TURN_COLUMNS

__all__ = ["gc_paused", "PreparedTurn", "PreparedToolCall", "prepare_turn", "prepare_message", "prepare_episode",
           "prepare_tool_call", "turn_row", "RUN_COLUMNS", "Rows", "Pricer", "ensure_arrow"]

# The columns a new run row is written with (the rest keep their defaults).
RUN_COLUMNS = ("id", "kind", "graph", "model_spec", "config", "status", "pid", "hostname", "proc_start", "parent_id",
               "closedloop_version", "started_at", "updated_at", "ended_at", "outcome", "error", "prompt_tokens",
               "completion_tokens", "cost_usd", "tags", "metadata")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a batch is prepared or decoded.

    A batch allocates hundreds of thousands of small containers (rows, bytes, turns) and frees
    none of them in a cycle, yet every 700 allocations start a collection and every few of those
    a full one, which walks every object the process holds (a trainer holds millions): measured,
    a third of the CPU time of a bulk write. Reference counting still frees everything at once;
    the collector resumes, as it was, when the batch is done.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(slots=True)
class PreparedTurn:
    """A turn as the ``turns`` table keeps it, before it has a run position or a price.

    Token ids, logprobs and loss mask are already the BLOBs of :mod:`closedloop.store.codec`."""

    model: str
    message: str
    prompt_ids: bytes | None
    completion_ids: bytes | None
    logprobs: bytes | None
    loss_mask: bytes | None
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
    media: str | None = None  # Turn.media as JSON (content addresses); None when the prompt had none


@dataclass(slots=True)
class PreparedToolCall:
    call_id: str | None
    name: str
    arguments: str
    result: str
    error: str | None
    error_kind: str | None
    latency_s: float | None


def _message_json(message: _Message, secrets: list[str], media: MediaSink | None = None) -> str:
    """Redacted JSON of a message; pydantic's own serialiser (3x faster than dump + json.dumps) when
    the text cannot hold a secret, the full redaction otherwise. With ``media``, image/audio
    payloads are moved out first (:mod:`closedloop.store.media`), so the secret check and the
    redaction never scan base64."""
    text = message.model_dump_json(exclude_none=True)
    if media is not None and might_hold_media(text):
        text = externalize_json(text, media)
    if not might_hold_secret(text, secrets):
        return text
    return _redacted_message_json(message, secrets, text)


def _redacted_message_json(message: _Message, secrets: list[str], text: str | None = None) -> str:
    """The redacted JSON; ``text``: the message's JSON as prepared, redacted as is when it holds
    media references (so they stay references), else the message is dumped again."""
    if text is not None and might_hold_refs(text):
        return redact_message_json(json.loads(text), secrets)
    return redact_message_json(message.model_dump(mode="json", exclude_none=True), secrets)


def prepare_message(message: _Message, secrets: list[str], media: MediaSink | None = None) -> tuple[str, str]:
    """(role, redacted JSON); with ``media``, image/audio payloads become references and their
    bytes go to the sink (the store writes them in the rows' transaction)."""
    return message.role, _message_json(message, secrets, media)


# LogprobSpec JSON by value: a batch has a handful of distinct specs, each serialised once.
_SPEC_JSON: dict[tuple[Any, ...], str] = {}


def _spec_json(spec: LogprobSpec | None) -> str | None:
    if spec is None:
        return None
    key = (spec.mode, spec.temperature, spec.top_p, spec.backend)
    js = _SPEC_JSON.get(key)
    if js is None:
        if len(_SPEC_JSON) > 1024:
            _SPEC_JSON.clear()
        js = _SPEC_JSON[key] = spec.model_dump_json()
    return js


def _turn_texts(turn: Turn, spec: str | None, unavailable: str | None) -> str:
    """Every text field of a turn except its message, for one secret check."""
    return f"{turn.model}\0{turn.finish_reason}\0{turn.purpose}\0{spec}\0{unavailable}\0{turn.completion_text}"


def _media_json(turn: Turn) -> str | None:
    if not turn.media:
        return None
    return "[" + ",".join(r.model_dump_json() for r in turn.media) + "]"


def prepare_turn(turn: Turn, secrets: list[str], message_json: str | None = None, *,
                 clean: bool = False, unavailable: str | None = None, media: MediaSink | None = None) -> PreparedTurn:
    """Redaction, token counts and the array BLOBs, done before any transaction so the file lock
    is held briefly.

    ``message_json``: the turn's message already prepared (it is usually also in the message
    list of its trajectory), so it is not serialised and redacted twice. Every text field is
    checked for secrets (token ids, logprobs and the mask are numbers and cannot hold one);
    ``clean``: the caller has checked them already, with :func:`might_hold_secret` answering no
    (and passes ``unavailable`` as it serialised it for that check). ``media``: see
    :func:`prepare_message`.
    """
    if message_json is None:
        message_json = _message_json(turn.message, secrets, media)
    spec = _spec_json(turn.logprob_spec)
    if unavailable is None and turn.unavailable:
        unavailable = json.dumps(turn.unavailable)
    model, finish, purpose, text = turn.model, turn.finish_reason, turn.purpose, turn.completion_text
    if not clean and might_hold_secret(_turn_texts(turn, spec, unavailable), secrets):
        def scrub(value: str | None) -> str | None:
            return redact_text(value, key_values=False, env_secrets=secrets) if value else value

        model, finish, purpose, text = scrub(model), scrub(finish), scrub(purpose), scrub(text)
        if turn.logprob_spec is not None:
            spec = turn.logprob_spec.model_copy(update={"backend": scrub(turn.logprob_spec.backend)}).model_dump_json()
        if unavailable is not None:  # keys name fields ("token_ids"), values are free-text reasons
            unavailable = json.dumps(redact(turn.unavailable, keys=False, env_secrets=secrets))
    prompt_ids, completion_ids, mask = turn.prompt_ids, turn.completion_ids, turn.loss_mask
    if mask is not None and prompt_ids is not None and completion_ids is not None and \
            len(mask) == len(prompt_ids) + len(completion_ids) and \
            mask == [0] * len(prompt_ids) + [1] * len(completion_ids):
        mask = None  # the default mask (see codec): what Turn fills in, and what a read restores
    return PreparedTurn(
        model=model, message=message_json, prompt_ids=encode_ids(prompt_ids, "prompt_ids"),
        completion_ids=encode_ids(completion_ids, "completion_ids"), logprobs=encode_floats(turn.logprobs),
        loss_mask=encode_mask(mask), completion_text=text, finish_reason=finish,
        prompt_tokens=turn.usage.prompt_tokens or len(prompt_ids or ()),
        completion_tokens=turn.usage.completion_tokens or len(completion_ids or ()),
        cost_usd=turn.usage.cost_usd, latency_s=turn.latency_s, logprob_spec=spec,
        trainable=turn.trainable, purpose=purpose, unavailable=unavailable, media=_media_json(turn))


def prepare_episode(messages: Sequence[_Message], turns: Sequence[Turn], secrets: list[str],
                    media: MediaSink | None = None) -> tuple[list[tuple[str, str]], list[PreparedTurn]]:
    """Messages and turns of one episode; a turn's message that is also in ``messages`` (the same
    object, as graphs and environments produce them) is serialised once.

    The secret check is done once for the whole episode: every text is serialised, and one
    :func:`might_hold_secret` over all of them joined by NUL (which no trigger or JSON-plain
    secret contains, so nothing can match across a boundary) clears the common episode without
    a credential in one pass; otherwise each text is checked and redacted on its own.

    ``media``: image/audio payloads become references, bytes to the sink, before any secret check
    (a text without media parts pays one substring test).
    """
    jsons = [m.model_dump_json(exclude_none=True) for m in messages]
    by_id = {id(m): i for i, m in enumerate(messages)}
    turn_jsons = [None if id(t.message) in by_id else t.message.model_dump_json(exclude_none=True) for t in turns]
    if media is not None:
        jsons = [externalize_json(js, media) if might_hold_media(js) else js for js in jsons]
        turn_jsons = [externalize_json(js, media) if js is not None and might_hold_media(js) else js
                      for js in turn_jsons]
    unavailable = [json.dumps(t.unavailable) if t.unavailable else None for t in turns]
    texts = [*jsons, *(j for j in turn_jsons if j is not None),
             *(_turn_texts(t, _spec_json(t.logprob_spec), u) for t, u in zip(turns, unavailable))]
    clean = not might_hold_secret("\0".join(texts), secrets)
    if not clean:
        jsons = [js if not might_hold_secret(js, secrets) else _redacted_message_json(m, secrets, js)
                 for m, js in zip(messages, jsons)]
        turn_jsons = [js if js is None or not might_hold_secret(js, secrets)
                      else _redacted_message_json(t.message, secrets, js) for t, js in zip(turns, turn_jsons)]
    prepared_messages = [(m.role, js) for m, js in zip(messages, jsons)]
    return prepared_messages, [prepare_turn(t, secrets, js if js is not None else jsons[by_id[id(t.message)]],
                                            clean=clean, unavailable=u)
                               for t, js, u in zip(turns, turn_jsons, unavailable)]


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
            t.logprob_spec, t.trainable, t.purpose, t.unavailable, t.media]


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
                  "prompt_ids": pa.binary(), "completion_ids": pa.binary(), "logprobs": pa.binary(),
                  "loss_mask": pa.binary(),
                  "completion_text": pa.string(), "finish_reason": pa.string(), "prompt_tokens": pa.int64(),
                  "completion_tokens": pa.int64(), "cost_usd": pa.float64(), "latency_s": pa.float64(),
                  "created_at": ts, "logprob_spec": pa.string(), "trainable": pa.bool_(), "purpose": pa.string(),
                  "unavailable": pa.string(), "media": pa.string()},
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

    def extend(self, table: str, rows: list[Sequence[Any]]) -> None:
        """Rows this module built itself, in the table's column order (no per-row check)."""
        self.tables[table].extend(rows)

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
            arrow = pa.table({name: pa.array(values, type=types[table][name])
                              for name, values in zip(_COLUMNS[table], columns)})
            view = f"_closedloop_batch_{table}"
            _finish_pending(con)
            con.register(view, arrow)
            try:
                con.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM {view}")
            finally:
                _finish_pending(con)
                con.unregister(view)


def _finish_pending(con: duckdb.DuckDBPyConnection) -> None:
    """DuckDB >= 2 refuses ``register`` while an ``execute`` result is unread; older ones lack ``complete``."""
    complete = getattr(con, "complete", None)
    if complete is not None:
        complete()
