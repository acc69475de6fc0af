"""Finished episodes written whole: each trajectory one run with its messages and turns, all in one transaction.

The cheap path for trainers that log hundreds of rollouts and for evaluations that must never
leave half an episode: everything is prepared (redacted, encoded, priced, laid out in rows, see
:mod:`closedloop.store.batch`) before the transaction, so the file is held only for one
vectorised insert per table. All or nothing: if any id already exists, nothing is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence

import duckdb

import closedloop
from closedloop.messages import Trajectory
from closedloop.redact import env_secrets, redact, redact_spec
from closedloop.store.batch import Pricer, Rows, prepare_episode, turn_row
from closedloop.store.errors import RunStateError
from closedloop.store.media import MediaSink, write_media
from closedloop.store.pricing import PriceFn
from closedloop.store.process import hostname, process_start
from closedloop.store.records import utcnow
from closedloop.store.runs import check_kind, check_terminal
from closedloop.store.values import dumps, format_error, jsonable, redacted_json, redacted_label, redacted_tags

__all__ = ["RunDefaults", "Episode", "PreparedBatch", "check_batch", "prepare_batch", "bulk_settings"]


@dataclass(slots=True)
class RunDefaults:
    """What every run of one bulk write shares."""

    kind: str
    status: str
    graph: str | None
    model_spec: str | None
    config: Any
    tags: Sequence[str] | None
    parent_id: str | None


@dataclass(slots=True)
class Episode:
    """One trajectory to record and what its run row adds to it."""

    trajectory: Trajectory
    outcome: Mapping[str, Any] | None = None
    started_at: datetime | None = None
    error: BaseException | str | None = None


def check_batch(defaults: RunDefaults, episodes: list[Episode]) -> list[str]:
    """The run ids (the trajectories' ids) after checking the batch; a bad batch raises before anything is prepared."""
    check_terminal(defaults.status)
    check_kind(defaults.kind)
    for episode in episodes:
        if not isinstance(episode.trajectory, Trajectory):
            raise TypeError(f"expected closedloop.messages.Trajectory, got {type(episode.trajectory).__name__}")
    ids = [e.trajectory.id for e in episodes]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"trajectory ids repeat within the batch: {', '.join(dup[:5])}")
    return ids


@dataclass(slots=True)
class PreparedBatch:
    """Rows of every table for a batch of episodes, and :meth:`write` to insert them in a transaction."""

    ids: list[str]
    rows: Rows
    sink: MediaSink
    media_refs: list[tuple[str, str]]
    now: datetime

    def write(self, con: duckdb.DuckDBPyConnection) -> list[str]:
        # A semi-join (hashed), not list_contains: that compares every run with every new id.
        taken = con.execute("SELECT id FROM runs WHERE id IN (SELECT unnest(?::VARCHAR[])) LIMIT 5",
                            [self.ids]).fetchall()
        if taken:
            raise RunStateError(f"a run with id {taken[0][0]!r} already exists"
                                + (f" (and {len(taken) - 1} more)" if len(taken) > 1 else ""))
        if self.media_refs:
            write_media(con, self.sink, self.media_refs, self.now)
        self.rows.insert(con)
        return self.ids


def prepare_batch(defaults: RunDefaults, episodes: list[Episode], ids: list[str], price_fn: PriceFn) -> PreparedBatch:
    """Every row of the batch, redacted and priced. The run's outcome is ``{"rewards": ...,
    "step_rewards": ..., **outcome}``; turns without a cost are priced by ``price_fn``."""
    secrets = env_secrets()
    cfg = dumps(redact(jsonable(defaults.config) or {}, env_secrets=secrets))
    tags = redacted_tags(defaults.tags, secrets)
    graph = redacted_label(defaults.graph, secrets)
    spec = redact_spec(defaults.model_spec)
    pid, host = os.getpid(), hostname()
    proc = process_start(pid)
    version = closedloop.__version__
    rows, now, pricer = Rows(), utcnow(), Pricer(price_fn)
    sink, media_refs = MediaSink(), []
    turn_rows = rows.tables["turns"]
    for episode in episodes:
        traj = episode.trajectory
        run_id = traj.id
        meta = redacted_json(traj.metadata or {}, secrets)
        steps = {"step_rewards": traj.step_rewards} if traj.step_rewards else {}
        out = redacted_json({"rewards": traj.rewards, **steps, **(jsonable(episode.outcome) or {})}, secrets,
                            keys=False, key_values=False)
        messages, turns, redacted = prepare_episode(traj.messages, traj.turns, secrets, sink)
        if sink.pending:
            media_refs += [(run_id, h) for h in sink.take()]
        rows.extend("messages", [(run_id, i, role, js) for i, (role, js) in enumerate(messages)])
        p_tok = c_tok = 0
        cost: float | None = None
        for i, t in enumerate(turns):
            c = t.cost_usd if t.cost_usd is not None else pricer(t.model or defaults.model_spec or "",
                                                                t.prompt_tokens, t.completion_tokens)
            turn_rows.append(turn_row(run_id, i, t, c, now))
            p_tok += t.prompt_tokens
            c_tok += t.completion_tokens
            if c is not None:
                cost = (cost or 0.0) + c
        rows.add("runs", (run_id, defaults.kind, graph, spec, cfg, defaults.status, pid, host, proc,
                          defaults.parent_id, version, episode.started_at or now, now, now, out,
                          format_error(episode.error), p_tok, c_tok, cost, tags, meta, redacted))
    return PreparedBatch(ids, rows, sink, media_refs, now)


def bulk_settings(con: duckdb.DuckDBPyConnection) -> None:
    """A bulk write checkpoints at its commit instead of first copying its rows into the WAL.

    Every connection of the store checkpoints when it closes (the file is released between
    writes, and a reader must not replay a WAL), so a big transaction's rows would be written
    twice: to the WAL at commit, then into the table's blocks on close. A commit whose WAL would
    exceed ``checkpoint_threshold`` skips the WAL and checkpoints instead (DuckDB's automatic
    checkpoint); with the threshold at 0 that is every bulk commit. Durability is the same: the
    commit returns once the checkpoint has been written.
    """
    con.execute("SET checkpoint_threshold = '0b'")
