"""Many runs read back as trajectories, in batches: what ``RunStore.iter_trajectories`` is made of.

One query selects the runs (:func:`select_runs`: the run filter, then metadata and reward
filters in Python); then each batch of runs costs one read transaction and two queries
(:func:`read_batch`: messages, turns, and the media they reference), released before the batch
is decoded (:func:`decode_batch`), so a slow consumer never holds the file. The first batch is
read on the selecting connection: opening the file costs ~15 ms of CPU (DuckDB builds its
catalog), as much as decoding ~1,000 turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import duckdb

from closedloop.messages import Trajectory
from closedloop.store.batch import gc_paused
from closedloop.store.media import MediaMode, Restorer
from closedloop.store.reads import TURN_READ, messages_from_json, restorer, turn_from_row
from closedloop.store.records import reward_dict, trajectory_metadata
from closedloop.store.values import loads

__all__ = ["Selected", "Batch", "select_runs", "read_batch", "decode_batch"]


@dataclass(frozen=True, slots=True)
class Selected:
    """A selected run: what its trajectory takes from the run row."""

    run_id: str
    rewards: dict[str, float]
    step_rewards: list[Any]
    metadata: dict[str, Any]


@dataclass(slots=True)
class Batch:
    """The stored rows of a batch of runs: message JSON and turn rows by run id, and the media they reference."""

    messages: dict[str, list[str]] = field(default_factory=dict)
    turns: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    restore: Restorer | None = None


def select_runs(con: duckdb.DuckDBPyConnection, where: str, params: list[Any], *, metadata: Mapping[str, Any],
                min_reward: float | None, limit: int | None) -> list[Selected]:
    """The runs ``where`` selects, oldest first, that have every ``metadata`` pair and (with
    ``min_reward``) summed outcome rewards at least that (runs without rewards never); at most ``limit``."""
    heads = con.execute(
        "SELECT id, kind, graph, model_spec, status, parent_id, tags, metadata, "
        "json_extract(config, '$.task_id'), json_extract(outcome, '$.task_id'), "
        "json_extract(outcome, '$.rewards'), json_extract(outcome, '$.step_rewards') FROM runs "
        f"{where} ORDER BY started_at, rowid", params).fetchall()
    selected = []
    for rid, kind, graph, spec, status, parent, tags, meta, cfg_task, out_task, rewards_js, steps_js in heads:
        meta = loads(meta) or {}
        if any(meta.get(k) != v for k, v in metadata.items()):
            continue
        rewards = reward_dict(rid, loads(rewards_js))
        if min_reward is not None and (not rewards or sum(rewards.values()) < min_reward):
            continue
        md = trajectory_metadata(run_id=rid, kind=kind, graph=graph, model_spec=spec, status=status,
                                 tags=tags or [], parent_id=parent, metadata=meta,
                                 config_task_id=loads(cfg_task), outcome_task_id=loads(out_task))
        selected.append(Selected(rid, rewards, list(loads(steps_js) or []), md))
        if limit is not None and len(selected) >= limit:
            break
    return selected


def read_batch(con: duckdb.DuckDBPyConnection, ids: list[str], media: MediaMode) -> Batch:
    """The rows of these runs, in two queries; with ``media="inline"`` the media bytes they
    reference too (fetched here, restored after the file is released)."""
    batch = Batch({i: [] for i in ids}, {i: [] for i in ids})
    if not ids:
        return batch
    raw = con.execute("SELECT run_id, json FROM messages WHERE run_id IN "
                      "(SELECT unnest(?::VARCHAR[])) ORDER BY run_id, idx", [ids]).fetchall()
    for rid, js in raw:
        batch.messages[rid].append(js)
    turn_rows = con.execute(f"SELECT run_id, {TURN_READ} FROM turns WHERE run_id IN "
                            "(SELECT unnest(?::VARCHAR[])) ORDER BY run_id, idx", [ids]).fetchall()
    for row in turn_rows:
        batch.turns[row[0]].append(row[1:])
    if media == "inline":
        batch.restore = restorer(con, (js for _, js in raw), turn_rows, 2)
    return batch


def decode_batch(chunk: list[Selected], batch: Batch) -> list[Trajectory]:
    """The trajectories of a batch, each equal to ``load_trajectory`` of its run."""
    restore = batch.restore
    out = []
    with gc_paused():
        for run in chunk:
            raw = batch.messages[run.run_id]
            messages = messages_from_json([restore(js) for js in raw] if restore is not None else raw)
            by_json = dict(zip(raw, messages))
            turns = [turn_from_row(r, by_json, restore) for r in batch.turns[run.run_id]]
            out.append(Trajectory.model_construct(id=run.run_id, messages=messages, turns=turns,
                                                  rewards=run.rewards, step_rewards=run.step_rewards,
                                                  metadata=run.metadata))
    return out
