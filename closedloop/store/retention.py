"""Retention: finished runs older than a cutoff deleted with their rows, and media no run references any more.

Running runs are never deleted, however old: a long training job is still writing to them (runs
whose process is gone are marked ``killed`` first, and then count as finished).
"""

from __future__ import annotations

from datetime import datetime

import duckdb

from closedloop.store.media import collect_garbage
from closedloop.store.runs import reap

__all__ = ["delete_finished_before"]

_CHILD_TABLES = ("messages", "turns", "tool_calls", "metrics")


def delete_finished_before(con: duckdb.DuckDBPyConnection, cutoff: datetime, *, detect_killed: bool) -> int:
    """Delete the runs that ended (or were last written) before ``cutoff`` (naive UTC), in the
    caller's write transaction; returns how many."""
    reap(con, detect_killed=detect_killed)
    ids = [r[0] for r in con.execute("SELECT id FROM runs WHERE status <> 'running' AND "
                                     "coalesce(ended_at, updated_at) < ?", [cutoff]).fetchall()]
    if not ids:
        return 0
    for table in _CHILD_TABLES:
        con.execute(f"DELETE FROM {table} WHERE list_contains(?, run_id)", [ids])
    con.execute("DELETE FROM runs WHERE list_contains(?, id)", [ids])
    collect_garbage(con, ids)  # media no remaining run references
    return len(ids)
