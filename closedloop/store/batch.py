"""Rows ready for the store, and many of them inserted with one statement per table.

Two costs dominate a naive writer: opening the DuckDB file (tens of ms, see ``store.py``) and one
``execute`` per row (about a millisecond each once parameters, list columns and the catalog lookup
are counted; ``executemany`` is no cheaper). The bulk path pays neither per row: everything a run
needs is prepared (redacted, serialised, counted) in Python first, collected into columns, and
handed to DuckDB as one Arrow table per store table (``INSERT ... SELECT`` over a registered Arrow
table is a vectorised copy), or, for a few rows, as one multi-row ``VALUES`` statement.

``pyarrow`` is imported only when a table of a write reaches :data:`SMALL_BATCH` rows, on a thread
of its own (:func:`arrow_ready`); it is installed with ``datasets``, a core dependency.

Preparation never raises on what a model or a tool produced: text DuckDB cannot store (lone
surrogates, from bytes decoded with ``surrogateescape``) becomes U+FFFD (:func:`storable`), and
a tool call whose fields cannot be prepared is stored with an error saying so
(:func:`prepare_tool_call`), so one hostile call never costs the rows around it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import duckdb
from pydantic_core import PydanticSerializationError

from closedloop.messages import LogprobSpec, Turn, _Message
from closedloop.redact import REDACTED, might_hold_secret, redact, redact_arguments, redact_text, redacted_message_json
from closedloop.store.codec import encode_floats, encode_ids, encode_mask
from closedloop.store.media import MediaSink, externalize_json, might_hold_media, might_hold_refs
from closedloop.store.pricing import cost_usd, price_for
from closedloop.store.schema import (MESSAGE_COLUMNS, METRIC_COLUMNS, RUN_COLUMNS, TOKEN_IDS_REDACTED,
                                     TOOL_CALL_COLUMNS, TURN_COLUMNS, arrow_types)

__all__ = ["gc_paused", "PreparedTurn", "PreparedToolCall", "PreparedEpisode", "prepare_turn", "prepare_message",
           "prepare_episode", "prepare_tool_call", "without_token_ids", "TOKEN_IDS_REDACTED", "storable", "turn_row",
           "RUN_COLUMNS", "Rows", "Pricer", "ensure_arrow", "arrow_ready"]

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

    Token ids, logprobs and loss mask are already the BLOBs of :mod:`closedloop.store.codec`.
    ``redacted``: a credential was removed from the turn's own text (its message, completion
    text, ...), so its token ids still encode it (see :func:`without_token_ids`)."""

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
    redacted: bool = False


@dataclass(slots=True)
class PreparedToolCall:
    call_id: str | None
    name: str
    arguments: str
    result: str
    error: str | None
    error_kind: str | None
    latency_s: float | None


class PreparedEpisode(NamedTuple):
    """Messages as ``(role, json)`` and turns of one episode (or queued step); ``redacted``: a
    credential was removed from some message or turn text of it."""

    messages: list[tuple[str, str]]
    turns: list[PreparedTurn]
    redacted: bool


def without_token_ids(turn: PreparedTurn) -> PreparedTurn:
    """The turn without token ids, logprobs and loss mask, untrainable, with the reason in
    ``unavailable["token_ids"]``.

    Why drop them instead of replacing the redacted span's tokens by the marker's: the store has
    no tokenizer (and an API backend's turn has none anywhere), so it cannot tell which ids
    encode the removed text; and a turn whose text was changed is no longer token-exact, so a
    trainer must not learn from it anyway. Trainers read the reason where they read a backend's
    own ``unavailable`` reasons (``Trajectory`` refuses to build training tokens without ids and
    says why); counts (``prompt_tokens``, ...) and the redacted texts stay.
    """
    reasons = json.loads(turn.unavailable) if turn.unavailable else {}
    reasons["token_ids"] = TOKEN_IDS_REDACTED
    return dataclasses.replace(turn, prompt_ids=None, completion_ids=None, logprobs=None, loss_mask=None,
                               trainable=False, unavailable=json.dumps(reasons))


_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(text: str) -> str:
    """``text`` with lone surrogates replaced by U+FFFD. A Python string may hold them (bytes
    decoded with ``surrogateescape``, broken UTF-16 from a tool); DuckDB stores UTF-8 only and
    would refuse the whole batch they are in."""
    if text.isascii() or not _SURROGATE.search(text):
        return text
    return _SURROGATE.sub("\ufffd", text)


def _dump_json(message: _Message) -> str:
    """The message's JSON; pydantic's own serialiser (3x faster than dump + json.dumps), or, for
    text it cannot encode (lone surrogates), the same JSON made storable."""
    try:
        return message.model_dump_json(exclude_none=True)
    except PydanticSerializationError:
        return storable(json.dumps(message.model_dump(mode="json", exclude_none=True), ensure_ascii=False,
                                   separators=(",", ":")))


def _message_json(message: _Message, secrets: list[str], media: MediaSink | None = None) -> tuple[str, bool]:
    """Redacted JSON of a message and whether anything was redacted; the full redaction only when
    the text might hold a secret. With ``media``, image/audio payloads are moved out first
    (:mod:`closedloop.store.media`), so the secret check and the redaction never scan base64."""
    text = _dump_json(message)
    if media is not None and might_hold_media(text):
        text = externalize_json(text, media)
    if not might_hold_secret(text, secrets):
        return text, False
    return _redacted_message_json(message, secrets, text)


def _redacted_message_json(message: _Message, secrets: list[str], text: str | None = None) -> tuple[str, bool]:
    """The redacted JSON; ``text``: the message's JSON as prepared, redacted as is when it holds
    media references (so they stay references), else the message is dumped again."""
    if text is not None and might_hold_refs(text):
        out, redacted = redacted_message_json(json.loads(text), secrets)
    else:
        out, redacted = redacted_message_json(message.model_dump(mode="json", exclude_none=True), secrets)
    return storable(out), redacted


def prepare_message(message: _Message, secrets: list[str], media: MediaSink | None = None) -> tuple[str, str, bool]:
    """(role, redacted JSON, whether anything was redacted); with ``media``, image/audio parts
    become references and their bytes go to the sink (the store writes them in the rows'
    transaction)."""
    role = message.role  # type: ignore[attr-defined]  # every concrete message has one
    return (role, *_message_json(message, secrets, media))


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


def _json(value: Any) -> str:
    return storable(json.dumps(value, ensure_ascii=False))


def prepare_turn(turn: Turn, secrets: list[str], message_json: str | None = None, *, message_redacted: bool = False,
                 clean: bool = False, unavailable: str | None = None, media: MediaSink | None = None) -> PreparedTurn:
    """Redaction, token counts and the array BLOBs, done before any transaction so the file lock
    is held briefly.

    ``message_json``: the turn's message already prepared (it is usually also in the message
    list of its trajectory), so it is not serialised and redacted twice; ``message_redacted``:
    whether that preparation redacted something. Every text field is checked for secrets (token
    ids, logprobs and the mask are numbers and cannot hold one); ``clean``: the caller has
    checked them already, with :func:`might_hold_secret` answering no (and passes
    ``unavailable`` as it serialised it for that check). ``media``: see :func:`prepare_message`.
    A turn whose own text lost a secret is returned :func:`without_token_ids`.
    """
    if message_json is None:
        message_json, message_redacted = _message_json(turn.message, secrets, media)
    spec = _spec_json(turn.logprob_spec)
    if unavailable is None and turn.unavailable:
        unavailable = _json(turn.unavailable)
    model, finish, purpose, text = turn.model, turn.finish_reason, turn.purpose, turn.completion_text
    redacted = message_redacted
    if not clean and might_hold_secret(_turn_texts(turn, spec, unavailable), secrets):
        def scrub(value: str | None) -> str | None:
            return redact_text(value, key_values=False, env_secrets=secrets) if value else value

        before = (model, finish, purpose, text)
        # model and purpose are str ("" at worst): scrub gives a str back for one
        model, finish, purpose, text = scrub(model) or model, scrub(finish), scrub(purpose) or purpose, scrub(text)
        redacted = redacted or (model, finish, purpose, text) != before
        if turn.logprob_spec is not None:
            spec = turn.logprob_spec.model_copy(update={"backend": scrub(turn.logprob_spec.backend)}).model_dump_json()
        if unavailable is not None:  # keys name fields ("token_ids"), values are free-text reasons
            unavailable = _json(redact(turn.unavailable, keys=False, env_secrets=secrets))
    prompt_ids, completion_ids, mask = turn.prompt_ids, turn.completion_ids, turn.loss_mask
    if mask is not None and prompt_ids is not None and completion_ids is not None and \
            len(mask) == len(prompt_ids) + len(completion_ids) and \
            mask == [0] * len(prompt_ids) + [1] * len(completion_ids):
        mask = None  # the default mask (see codec): what Turn fills in, and what a read restores
    prepared = PreparedTurn(
        model=storable(model), message=message_json, prompt_ids=encode_ids(prompt_ids, "prompt_ids"),
        completion_ids=encode_ids(completion_ids, "completion_ids"), logprobs=encode_floats(turn.logprobs),
        loss_mask=encode_mask(mask), completion_text=storable(text) if text else text,
        finish_reason=storable(finish) if finish else finish,
        prompt_tokens=turn.usage.prompt_tokens or len(prompt_ids or ()),
        completion_tokens=turn.usage.completion_tokens or len(completion_ids or ()),
        cost_usd=turn.usage.cost_usd, latency_s=turn.latency_s, logprob_spec=spec,
        trainable=turn.trainable, purpose=storable(purpose), unavailable=unavailable, media=_media_json(turn),
        redacted=redacted)
    return without_token_ids(prepared) if redacted else prepared


def prepare_episode(messages: Sequence[_Message], turns: Sequence[Turn], secrets: list[str],
                    media: MediaSink | None = None) -> PreparedEpisode:
    """Messages and turns of one episode; a turn's message that is also in ``messages`` (the same
    object, as graphs and environments produce them) is serialised once.

    The secret check is done once for the whole episode: every text is serialised, and one
    :func:`might_hold_secret` over all of them joined by NUL (which no trigger or JSON-plain
    secret contains, so nothing can match across a boundary) clears the common episode without
    a credential in one pass; otherwise each text is checked and redacted on its own.

    Token ids: a turn's prompt holds every message before its own, so once a message lost a
    secret, that turn and every later one lose their ids (:func:`without_token_ids`); a turn
    whose message is not in ``messages`` cannot be placed and loses them if any message did.
    Earlier steps of the same run are the caller's to account for (``PreparedEpisode.redacted``).

    ``media``: image/audio payloads become references, bytes to the sink, before any secret check
    (a text without media parts pays one substring test).
    """
    jsons = [_dump_json(m) for m in messages]
    by_id = {id(m): i for i, m in enumerate(messages)}
    turn_jsons = [None if id(t.message) in by_id else _dump_json(t.message) for t in turns]
    if media is not None:
        jsons = [externalize_json(js, media) if might_hold_media(js) else js for js in jsons]
        turn_jsons = [externalize_json(js, media) if js is not None and might_hold_media(js) else js
                      for js in turn_jsons]
    unavailable = [_json(t.unavailable) if t.unavailable else None for t in turns]
    texts = [*jsons, *(j for j in turn_jsons if j is not None),
             *(_turn_texts(t, _spec_json(t.logprob_spec), u) for t, u in zip(turns, unavailable))]
    if not might_hold_secret("\0".join(texts), secrets):
        return PreparedEpisode([(m.role, js) for m, js in zip(messages, jsons)],  # type: ignore[attr-defined]
                               [prepare_turn(t, secrets, js if js is not None else jsons[by_id[id(t.message)]],
                                             clean=True, unavailable=u)
                                for t, js, u in zip(turns, turn_jsons, unavailable)], False)
    checked = [_redacted_message_json(m, secrets, js) if might_hold_secret(js, secrets) else (js, False)
               for m, js in zip(messages, jsons)]
    first = next((i for i, (_, redacted) in enumerate(checked) if redacted), None)
    prepared = []
    for t, js, u in zip(turns, turn_jsons, unavailable):
        at = by_id.get(id(t.message))
        if js is None:
            own, own_redacted = checked[at] if at is not None else (js, False)
        else:
            own, own_redacted = _redacted_message_json(t.message, secrets, js) if might_hold_secret(js, secrets) \
                else (js, False)
        after_secret = first is not None and (at is None or first <= at)
        prepared.append(prepare_turn(t, secrets, own, message_redacted=own_redacted or after_secret, unavailable=u))
    return PreparedEpisode([(m.role, js) for m, (js, _) in zip(messages, checked)],  # type: ignore[attr-defined]
                           prepared,
                           first is not None or any(p.redacted for p in prepared))


def _number_or_none(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError, OverflowError):
        return None


UNRECORDABLE = "unrecordable"  # ToolCallRecord.error_kind of a call whose fields the store could not keep


def prepare_tool_call(call_id: str | None, name: str, arguments: str, content: str, error: str | None,
                      error_kind: str | None, latency_s: float | None, secrets: list[str]) -> PreparedToolCall:
    """A tool call's row, redacted. Never raises: a field that cannot be prepared (a type no
    tool should return, a bug in a redaction rule meeting hostile input) is stored as
    ``[REDACTED]`` and the call gets an error naming it (``error_kind="unrecordable"`` unless the
    call already failed), so that call alone shows the problem and its batch is written.

    The common call holds no credential: its fields are checked once, joined by NUL (see
    :func:`prepare_episode`), and stored as they are when no rule could change any of them."""
    texts = (call_id or "", name, arguments, content, error or "", error_kind or "")
    if all(type(t) is str for t in texts) and not might_hold_secret("\0".join(texts), secrets):
        return PreparedToolCall(call_id=None if call_id is None else storable(call_id), name=storable(name),
                                arguments=storable(arguments), result=storable(content),
                                error=storable(error) if error else None,
                                error_kind=None if error_kind is None else storable(error_kind),
                                latency_s=_number_or_none(latency_s))
    failed: list[str] = []

    def field(label: str, prepare: Callable[[Any], str], value: Any) -> str:
        try:
            return storable(prepare(value))
        except Exception as e:  # noqa: BLE001 - see the docstring
            failed.append(f"{label} ({type(e).__name__})")
            return REDACTED

    def pattern_only(value: Any) -> str:
        return redact_text(value, key_values=False, env_secrets=secrets)

    row = PreparedToolCall(
        call_id=field("call id", pattern_only, call_id) if call_id is not None else None,
        name=field("name", pattern_only, name),
        arguments=field("arguments", lambda v: redact_arguments(v, env_secrets=secrets), arguments),
        result=field("result", pattern_only, content),
        error=field("error", lambda v: redact_text(v, env_secrets=secrets), error) if error else None,
        error_kind=field("error kind", pattern_only, error_kind) if error_kind is not None else None,
        latency_s=_number_or_none(latency_s))
    if failed:
        note = f"the run store could not record this call's {', '.join(failed)}"
        row.error = f"{row.error}; {note}" if row.error else note
        row.error_kind = row.error_kind or UNRECORDABLE
    return row


class Pricer:
    """``price_fn`` for one batch. The default price function re-reads the price table (and the
    environment) on every call; within one batch the table cannot change, so its lookup per model
    name is done once. A custom ``price_fn`` is called per turn, as documented."""

    def __init__(self, price_fn: Callable[[str, int, int], float | None]) -> None:
        self._fn = price_fn
        self._default = price_fn is cost_usd
        self._prices: dict[str, Any] = {}
        self._lookup = price_for

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
_ARROW_WARMING: threading.Thread | None = None
_ARROW_LOCK = threading.Lock()
# Below this many rows a table is inserted with multi-row ``VALUES`` statements: as cheap as an
# Arrow table at this size, and it needs no pyarrow at all (see :func:`arrow_ready`).
SMALL_BATCH = 32
# From this many rows a table waits for pyarrow instead of taking ``VALUES`` statements meanwhile:
# those cost some 75 µs a row, the import about 0.4 s of CPU.
LARGE_BATCH = 2000


def ensure_arrow() -> bool:
    """Import pyarrow and what its first conversion imports (pandas, through its shim); True if ready.

    Runs on its own thread (:func:`arrow_ready`); a first import during interpreter exit fails
    ("can't register atexit after shutdown"), and then the inserts take the ``VALUES`` path.
    """
    global _ARROW_READY
    if not _ARROW_READY:
        try:
            import pyarrow as pa

            pa.array([0], type=pa.int32())
            arrow_types()
        except (ImportError, RuntimeError):
            return False
        _ARROW_READY = True
    return True


def arrow_ready(*, wait: bool) -> bool:
    """True once pyarrow is imported and warmed up. Otherwise the import starts on a thread of its
    own (once per process), so the caller's thread (an event loop, a trainer's step) never pays
    it; ``wait`` waits for it (a table so large that ``VALUES`` statements would cost more). False when
    pyarrow cannot be had (not installed, or the interpreter is exiting)."""
    global _ARROW_WARMING
    if _ARROW_READY:
        return True
    with _ARROW_LOCK:
        thread = _ARROW_WARMING
        if thread is None:
            thread = threading.Thread(target=ensure_arrow, name="closedloop-arrow-import", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # no new threads at interpreter shutdown
                return False
            _ARROW_WARMING = thread
    if wait and thread is not threading.current_thread():
        thread.join()
    return _ARROW_READY


def _forget_warming_in_child() -> None:
    global _ARROW_WARMING, _ARROW_LOCK
    _ARROW_LOCK = threading.Lock()
    if not _ARROW_READY:
        _ARROW_WARMING = None  # an import under way at fork time never finishes in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_warming_in_child)


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
        """One statement per table. ``metrics`` rows replace those of the same (run, step, name)
        (its primary key): a resumed trainer logging a step again leaves one row, the latest."""
        for table, rows in self.tables.items():
            if not rows:
                continue
            names = ", ".join(_COLUMNS[table])
            verb = "INSERT"
            if table == "metrics":
                verb = "INSERT OR REPLACE"  # one statement may not touch a key twice: the last row wins
                rows = list({(r[0], r[1], r[2]): r for r in rows}.values())
            if len(rows) < SMALL_BATCH or not arrow_ready(wait=len(rows) >= LARGE_BATCH):
                _insert_values(con, f"{verb} INTO {table} ({names})", len(_COLUMNS[table]), rows)
                continue
            import pyarrow as pa

            types = arrow_types()
            columns = list(zip(*rows))  # column-major, in C
            arrow = pa.table({name: pa.array(values, type=types[table][name])
                              for name, values in zip(_COLUMNS[table], columns)})
            view = f"_closedloop_batch_{table}"
            _finish_pending(con)
            con.register(view, arrow)
            try:
                con.execute(f"{verb} INTO {table} ({names}) SELECT {names} FROM {view}")
            finally:
                _finish_pending(con)
                con.unregister(view)


#: Rows per multi-row ``VALUES`` statement (bounds one statement's parameters and parse).
VALUES_CHUNK = 128


def _insert_values(con: duckdb.DuckDBPyConnection, head: str, width: int, rows: list[Sequence[Any]]) -> None:
    """``rows`` inserted by multi-row ``INSERT ... VALUES (?, ...), (?, ...)`` statements.

    Why not ``executemany``: DuckDB runs it as one statement execution per row, about 1 ms each
    (measured at 1-2 ms a row, against a few hundred µs for one statement of twenty rows), and
    a queued batch of a graph run has tens of rows a table."""
    one = "(" + ", ".join("?" * width) + ")"
    for start in range(0, len(rows), VALUES_CHUNK):
        chunk = rows[start:start + VALUES_CHUNK]
        con.execute(f"{head} VALUES {', '.join([one] * len(chunk))}", [v for r in chunk for v in r])


def _finish_pending(con: duckdb.DuckDBPyConnection) -> None:
    """DuckDB >= 2 refuses ``register`` while an ``execute`` result is unread; older ones lack ``complete``."""
    complete = getattr(con, "complete", None)
    if complete is not None:
        complete()
