"""Reading runs back: run summaries by filter, one run whole, its metrics; stored rows as typed values.

Each function runs inside the caller's read transaction. The filter on run rows
(:func:`run_filter`) is the one that ``list_runs`` and ``iter_trajectories`` share. Turns are
rebuilt without re-validating their token ids (:func:`turn_from_row`), and media references in
message JSON become the recorded parts again when the caller asks for ``media="inline"``
(:mod:`closedloop.store.media`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import duckdb
from pydantic import TypeAdapter

from closedloop.messages import AssistantMessage, LogprobSpec, MediaRef, Message, Turn, Usage
from closedloop.redact import redact_spec
from closedloop.store.codec import decode_turn_arrays
from closedloop.store.errors import RunNotFoundError
from closedloop.store.media import MediaMode, Restorer, fetch_media, referenced_hashes
from closedloop.store.records import RunRecord, RunSummary, ToolCallRecord
from closedloop.store.values import loads, redacted_label

__all__ = ["run_filter", "summaries", "resolve", "read_run", "read_metrics", "check_media_mode", "TURN_READ",
           "turn_from_row", "messages_from_json", "restorer"]

# The ``turns`` columns :func:`turn_from_row` reads, in its order.
TURN_READ = ("model, message, prompt_ids, completion_ids, logprobs, loss_mask, completion_text, finish_reason, "
             "prompt_tokens, completion_tokens, cost_usd, latency_s, logprob_spec, trainable, purpose, unavailable, "
             "media")
_SUMMARY_COLUMNS = list(RunSummary.model_fields)
_MESSAGES: TypeAdapter[list[Any]] = TypeAdapter(list[Message])


def run_filter(*, status: str | None = None, graph: str | None = None, kind: str | None = None,
               parent_id: str | None = None, model_spec: str | None = None,
               tag: str | None = None) -> tuple[str, list[Any]]:
    """``WHERE`` over run rows (empty without filters) and its parameters: each given value must
    match exactly, ``tag`` be one of the run's tags. Graph names, tags and model specs are compared
    as stored, that is redacted."""
    where: list[str] = []
    params: list[Any] = []
    for column, value in (("status", status), ("graph", redacted_label(graph)), ("kind", kind),
                          ("parent_id", parent_id), ("model_spec", redact_spec(model_spec))):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if tag is not None:
        where.append("list_contains(tags, ?)")
        params.append(redacted_label(tag))
    return ("WHERE " + " AND ".join(where) if where else ""), params


def summaries(con: duckdb.DuckDBPyConnection, clause: str, params: list[Any]) -> list[RunSummary]:
    """The runs ``clause`` (``WHERE ... ORDER BY ...``) selects, as :class:`RunSummary`."""
    rows = con.execute(f"SELECT {', '.join(_SUMMARY_COLUMNS)} FROM runs {clause}", params).fetchall()
    out = []
    for row in rows:
        d = dict(zip(_SUMMARY_COLUMNS, row))
        for key in ("config", "outcome", "metadata"):
            d[key] = loads(d[key])
        d["config"] = d["config"] or {}
        d["metadata"] = d["metadata"] or {}
        d["tags"] = d["tags"] or []
        out.append(RunSummary(**d))
    return out


def resolve(con: duckdb.DuckDBPyConnection, prefix: str) -> str:
    """The id of the one run whose id is ``prefix`` or starts with it."""
    if not prefix:
        raise RunNotFoundError("empty run id")
    if con.execute("SELECT 1 FROM runs WHERE id = ?", [prefix]).fetchone():
        return prefix
    rows = con.execute("SELECT id FROM runs WHERE starts_with(id, ?) LIMIT 6", [prefix]).fetchall()
    if not rows:
        raise RunNotFoundError(f"no run with id {prefix!r}")
    if len(rows) > 1:
        raise RunNotFoundError(f"run id prefix {prefix!r} is ambiguous: {', '.join(r[0] for r in rows[:5])} ...")
    return str(rows[0][0])


def read_run(con: duckdb.DuckDBPyConnection, run_id: str, media: MediaMode) -> RunRecord:
    """The run (id or unique prefix) with its messages, turns and tool calls."""
    full = resolve(con, run_id)
    summary = summaries(con, "WHERE id = ?", [full])[0]
    raw = [r[0] for r in con.execute("SELECT json FROM messages WHERE run_id = ? ORDER BY idx", [full]).fetchall()]
    turn_rows = con.execute(f"SELECT {TURN_READ} FROM turns WHERE run_id = ? ORDER BY idx", [full]).fetchall()
    restore = restorer(con, raw, turn_rows, 1) if media == "inline" else None
    msgs = messages_from_json([restore(js) for js in raw] if restore is not None else raw)
    by_json = dict(zip(raw, msgs))
    turns = [turn_from_row(r, by_json, restore) for r in turn_rows]
    cur = con.execute("SELECT idx, turn_idx, call_id, name, arguments, result, error, error_kind, latency_s "
                      "FROM tool_calls WHERE run_id = ? ORDER BY idx", [full])
    cols = [d[0] for d in cur.description or ()]
    calls = [ToolCallRecord(**dict(zip(cols, r))) for r in cur.fetchall()]
    return RunRecord(**summary.model_dump(), messages=msgs, turns=turns, tool_calls=calls)


def read_metrics(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    """Per-step metrics of a run, oldest step first: ``[{"step": 0, "loss": ..., ...}, ...]``."""
    full = resolve(con, run_id)
    rows = con.execute("SELECT step, name, value FROM metrics WHERE run_id = ? ORDER BY step, created_at, rowid",
                       [full]).fetchall()
    by_step: dict[int, dict[str, Any]] = {}
    for step_no, name, value in rows:
        by_step.setdefault(step_no, {"step": step_no})[name] = value
    return list(by_step.values())


def check_media_mode(media: str) -> None:
    if media not in ("inline", "refs"):
        raise ValueError(f"media must be 'inline' (parts as recorded) or 'refs' (references, no bytes), got {media!r}")


def messages_from_json(rows: list[str]) -> list[Any]:
    """Stored message JSON back to typed messages: one validation in pydantic-core per run."""
    return _MESSAGES.validate_json("[" + ",".join(rows) + "]") if rows else []


def restorer(con: duckdb.DuckDBPyConnection, messages: Iterable[str], turn_rows: list[tuple[Any, ...]],
             message_column: int) -> Restorer | None:
    """A restorer holding the bytes these rows reference (one query), or None when they reference none."""
    hashes = referenced_hashes(messages)
    hashes |= referenced_hashes(r[message_column] for r in turn_rows)
    return Restorer(fetch_media(con, hashes)) if hashes else None


def turn_from_row(row: tuple[Any, ...], messages: Mapping[str, Any] | None = None,
                  restore: Callable[[str], str] | None = None) -> Turn:
    """A stored turn (the columns of :data:`TURN_READ`) as a :class:`Turn`.

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
        purpose=purpose or "policy", unavailable=loads(unavailable) or {},
        media=[MediaRef.model_validate(r) for r in loads(media)] if media else [])
