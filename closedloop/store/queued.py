"""The queued write path: what graph steps add, queued in microseconds and committed in batches.

``RunStore.log_step`` (what :class:`~closedloop.runtime.recording.StoreRecorder` calls from an
event loop) appends a :class:`Step` to the store's :class:`StepQueue`; a background thread
(:mod:`closedloop.store.writer`) commits everything queued so far, possibly for several runs, in
one transaction (:func:`write_steps`). ``StepQueue.flush_pending`` is the ack point: when it
returns, every step queued before it is committed. Stores with a queue are flushed at interpreter
exit; a forked child drops the queue it inherited (the parent writes it).

One run's problem never costs another run its rows: a step that cannot be prepared is dropped
alone, and a batch whose transaction fails for any reason but the lock is written again one
step per transaction, so only a step that fails on its own is dropped (and raised by the next
``RunStore.flush``).
"""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import duckdb

from closedloop.messages import ToolCall, Turn, _Message
from closedloop.redact import env_secrets
from closedloop.store.batch import (PreparedEpisode, PreparedToolCall, Pricer, Rows, prepare_episode, turn_row,
                                    without_token_ids)
from closedloop.store.errors import RunNotFoundError, RunStateError, StoreBusyError
from closedloop.store.media import MediaSink, write_media
from closedloop.store.pricing import PriceFn
from closedloop.store.records import utcnow
from closedloop.store.writer import BackgroundWriter, Holder, PartialBatch
from closedloop.store.writes import next_indices, prepare_call, price, take, tool_call_turn_idx
from closedloop.tool import ToolResult

__all__ = ["Step", "StepQueue", "write_steps"]

Transact = Callable[..., Any]  # StoreFile.transaction


@dataclass(slots=True)
class Step:
    """What one ``log_step`` (or ``log_metrics(wait=False)``) queued for a run."""

    run_id: str
    messages: list[_Message]
    turns: list[Turn]
    tool_calls: list[tuple[ToolCall, ToolResult, int | None]]
    metrics: list[tuple[int, str, float]]
    replace: bool = False


@dataclass(slots=True)
class _PreparedStep:
    """A queued step made ready for the table rows before the transaction."""

    step: Step
    episode: PreparedEpisode
    calls: list[tuple[PreparedToolCall, int | None]]
    media: list[str]  # hashes of the media its messages and turns reference


def _prepare_step(step: Step, secrets: list[str], sink: MediaSink) -> _PreparedStep:
    episode = prepare_episode(step.messages, step.turns, secrets, sink)
    calls = [(prepare_call(c, r, secrets), tool_call_turn_idx(i)) for c, r, i in step.tool_calls]
    return _PreparedStep(step, episode, calls, sorted(sink.take()))


class StepQueue:
    """One store's queue of steps and the background writer that commits them (started by the first step).

    ``label`` names the store in the writer thread's name and in warnings. :attr:`errors` holds
    the queued writes that failed since the store's last ``flush``. ``holder``: the store's file,
    kept open by the writer thread between batches (see :mod:`closedloop.store.writer`).
    """

    def __init__(self, *, label: str, interval_s: float, max_pending: int, holder: Holder | None = None) -> None:
        self.label, self.interval_s, self.max_pending = label, interval_s, max_pending
        self.holder = holder
        self._writer: BackgroundWriter | None = None
        self.errors: list[BaseException] = []

    def submit(self, step: Step, write: Callable[[list[Step]], None]) -> None:
        """Queue ``step``; ``write`` commits a batch of steps (the store's, through :func:`write_steps`).
        It is taken per call and kept only while the writer thread runs, so a store is referenced
        from its queue only while it has queued work (as from any thread that works for it)."""
        if self._writer is None:
            self._writer = BackgroundWriter(write, interval_s=self.interval_s,
                                            name=f"closedloop-store-writer:{self.label}", retryable=(StoreBusyError,),
                                            max_pending=self.max_pending, holder=self.holder)
            _open_queues.add(self)
        self._writer.submit(step)

    def flush_pending(self) -> None:
        """Commit every queued step now (also waits for a batch being written right now)."""
        writer = self._writer
        if writer is not None:
            writer.flush()
            self.errors.extend(writer.errors)
            writer.errors.clear()

    def report_dropped(self, run_id: str, error: BaseException) -> None:
        warnings.warn(f"run store: queued writes for run {run_id} were dropped: {error}", RuntimeWarning, stacklevel=3)
        if self._writer is not None:
            self._writer.errors.append(error)

    def close(self) -> None:
        """Commit what is queued and stop the writer thread (a later step starts a new one)."""
        writer = self._writer
        if writer is not None:
            writer.close()
            self.errors.extend(writer.errors)
            self._writer = None
            _open_queues.discard(self)


def write_steps(transact: Transact, steps: list[Step], price_fn: PriceFn,
                report_dropped: Callable[[str, BaseException], None]) -> None:
    """Queued steps, possibly of several runs, in one transaction (see the module docstring)."""
    secrets = env_secrets()
    sink = MediaSink()
    prepared: list[_PreparedStep] = []
    for s in steps:
        try:
            prepared.append(_prepare_step(s, secrets, sink))
        except Exception as e:  # noqa: BLE001 - a bug meeting odd input: that step alone is lost, and said so
            sink.take()
            report_dropped(s.run_id, e)
    if not prepared:
        return
    failed: dict[str, BaseException]
    try:
        failed = transact(lambda con: _write_prepared(con, prepared, sink, price_fn))
    except StoreBusyError as busy:
        raise PartialBatch([p.step for p in prepared], busy) from None
    except Exception as e:  # noqa: BLE001 - isolate the step that fails, keep the others
        if len(prepared) == 1:
            failed = {prepared[0].step.run_id: e}
        else:
            failed = {}
            for i, p in enumerate(prepared):
                try:
                    failed.update(transact(lambda con, one=[p]: _write_prepared(con, one, sink, price_fn)))
                except StoreBusyError as busy:
                    raise PartialBatch([q.step for q in prepared[i:]], busy) from None
                except Exception as one_error:  # noqa: BLE001
                    failed.setdefault(p.step.run_id, one_error)
    for rid, error in failed.items():
        report_dropped(rid, error)


def _write_prepared(con: duckdb.DuckDBPyConnection, prepared: list[_PreparedStep], sink: MediaSink,
                    price_fn: PriceFn) -> dict[str, BaseException]:
    """The rows of prepared steps, in the caller's transaction; returns the runs not written
    to (gone or not running) with the reason."""
    failed: dict[str, BaseException] = {}
    ids = sorted({p.step.run_id for p in prepared})
    state = {r[0]: (r[1], r[2], bool(r[3])) for r in con.execute(
        "SELECT id, status, model_spec, secrets_redacted FROM runs WHERE list_contains(?, id)", [ids]).fetchall()}
    live = [i for i in ids if state.get(i, ("",))[0] == "running"]
    nxt = {t: next_indices(con, t, live) for t in ("messages", "turns", "tool_calls")}
    rows, now, pricer = Rows(), utcnow(), Pricer(price_fn)
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
            rows.add("messages", (rid, take(nxt["messages"], rid), role, js))
        for t in p.episode.turns:
            if rid in tainted:  # an earlier step lost a secret: this prompt still holds it
                t = without_token_ids(t)
            cost = price(t, state[rid][1], pricer)
            rows.add("turns", turn_row(rid, take(nxt["turns"], rid), t, cost, now))
            tot[0] += t.prompt_tokens
            tot[1] += t.completion_tokens
            if cost is not None:
                tot[2] = (tot[2] or 0.0) + cost
        if p.episode.redacted:
            tainted.add(rid)
        for c, turn_idx in p.calls:
            t_idx = turn_idx if turn_idx is not None else (nxt["turns"][rid] - 1 if nxt["turns"][rid] else None)
            rows.add("tool_calls", (rid, take(nxt["tool_calls"], rid), t_idx, c.call_id, c.name, c.arguments,
                                    c.result, c.error, c.error_kind, c.latency_s, now))
        for step_no, name, value in p.step.metrics:
            rows.add("metrics", (rid, step_no, name, value, now))
    if media_refs:  # media of live runs only (a dropped step's bytes are not kept)
        write_media(con, sink, media_refs, now)
    rows.insert(con)
    if totals:
        _add_totals(con, totals, tainted, now)
    return failed


def _add_totals(con: duckdb.DuckDBPyConnection, totals: dict[str, list[Any]], tainted: set[str], now: Any) -> None:
    """Add each run's ``[prompt tokens, completion tokens, cost]`` of this batch to its row, in one statement."""
    con.execute("UPDATE runs SET prompt_tokens = runs.prompt_tokens + d.p, "
                "completion_tokens = runs.completion_tokens + d.c, "
                "cost_usd = CASE WHEN d.cost IS NULL THEN runs.cost_usd "
                "ELSE coalesce(runs.cost_usd, 0) + d.cost END, updated_at = ?, "
                "secrets_redacted = runs.secrets_redacted OR d.tainted "
                "FROM (SELECT unnest(?::VARCHAR[]) AS id, unnest(?::BIGINT[]) AS p, unnest(?::BIGINT[]) AS c, "
                "unnest(?::DOUBLE[]) AS cost, unnest(?::BOOLEAN[]) AS tainted) AS d WHERE runs.id = d.id",
                [now, list(totals), [v[0] for v in totals.values()], [v[1] for v in totals.values()],
                 [v[2] for v in totals.values()], [rid in tainted for rid in totals]])


# Queues with a writer thread, flushed at interpreter exit (atexit runs before daemon threads die).
_open_queues: "weakref.WeakSet[StepQueue]" = weakref.WeakSet()


def _forget_queues_in_child() -> None:
    """A forked child must not write its parent's queued steps a second time (the parent will)."""
    for queue in list(_open_queues):
        queue._writer = None
    _open_queues.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_queues_in_child)


@atexit.register
def _flush_at_exit() -> None:
    for queue in list(_open_queues):
        try:
            queue.close()
        except Exception as e:  # noqa: BLE001 - exit must go on; say what was lost
            warnings.warn(f"run store {queue.label}: queued writes could not be committed at exit: {e}",
                          RuntimeWarning, stacklevel=1)
