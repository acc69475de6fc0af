"""The store's tables and how a file written by an older closedloop is brought up to date.

``MIGRATIONS[i]`` takes a file from version ``i`` to ``i + 1``; version 0 is an empty file, so
``MIGRATIONS[0]`` creates the first schema. Each step runs in its own transaction together with
the version bump, so a crash mid-migration leaves the file at the last complete version.
"""

from __future__ import annotations

from typing import Callable

import duckdb

from closedloop.store.records import utcnow

__all__ = ["SCHEMA_VERSION", "MIGRATIONS", "TABLES", "StoreVersionError", "migrate", "current_version"]


class StoreVersionError(RuntimeError):
    """The file was written by a newer closedloop than this one."""


_V1 = [
    """CREATE TABLE IF NOT EXISTS runs (
        id VARCHAR PRIMARY KEY,
        kind VARCHAR NOT NULL,
        graph VARCHAR,
        model_spec VARCHAR,
        config JSON,
        status VARCHAR NOT NULL,
        pid INTEGER,
        hostname VARCHAR,
        proc_start BIGINT,
        parent_id VARCHAR,
        closedloop_version VARCHAR,
        started_at TIMESTAMP NOT NULL,
        updated_at TIMESTAMP NOT NULL,
        ended_at TIMESTAMP,
        outcome JSON,
        error VARCHAR,
        prompt_tokens BIGINT NOT NULL DEFAULT 0,
        completion_tokens BIGINT NOT NULL DEFAULT 0,
        cost_usd DOUBLE,
        tags VARCHAR[],
        metadata JSON
    )""",
    """CREATE TABLE IF NOT EXISTS messages (
        run_id VARCHAR NOT NULL,
        idx INTEGER NOT NULL,
        role VARCHAR NOT NULL,
        json JSON NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS turns (
        run_id VARCHAR NOT NULL,
        idx INTEGER NOT NULL,
        model VARCHAR,
        message JSON NOT NULL,
        prompt_ids INTEGER[],
        completion_ids INTEGER[],
        logprobs DOUBLE[],
        loss_mask TINYINT[],
        completion_text VARCHAR,
        finish_reason VARCHAR,
        prompt_tokens BIGINT NOT NULL DEFAULT 0,
        completion_tokens BIGINT NOT NULL DEFAULT 0,
        cost_usd DOUBLE,
        latency_s DOUBLE,
        created_at TIMESTAMP NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS tool_calls (
        run_id VARCHAR NOT NULL,
        idx INTEGER NOT NULL,
        turn_idx INTEGER,
        call_id VARCHAR,
        name VARCHAR NOT NULL,
        arguments VARCHAR,
        result VARCHAR,
        error VARCHAR,
        error_kind VARCHAR,
        latency_s DOUBLE,
        created_at TIMESTAMP NOT NULL
    )""",
]
# No secondary indexes: DuckDB's zone maps serve run_id lookups, and ART indexes on updated
# columns turn updates into delete+insert, which trips its eager constraint checks.


def _v0_to_v1(con: duckdb.DuckDBPyConnection) -> None:
    for stmt in _V1:
        con.execute(stmt)


MIGRATIONS: list[Callable[[duckdb.DuckDBPyConnection], None]] = [_v0_to_v1]
TABLES = ("runs", "messages", "turns", "tool_calls")


def _schema_version() -> int:
    return len(MIGRATIONS)


SCHEMA_VERSION = _schema_version()


def current_version(con: duckdb.DuckDBPyConnection) -> int:
    con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL, applied_at TIMESTAMP NOT NULL)")
    row = con.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def migrate(con: duckdb.DuckDBPyConnection) -> int:
    """Apply every missing step; returns the version reached. The caller holds no open transaction."""
    target = len(MIGRATIONS)  # read at call time so a test or plugin can append a step
    while True:
        con.execute("BEGIN TRANSACTION")
        try:
            version = current_version(con)
            if version > target:
                raise StoreVersionError(f"run store schema is version {version}, but this closedloop knows only "
                                        f"up to {target}; upgrade closedloop to read it")
            if version == target:
                con.execute("COMMIT")
                return version
            MIGRATIONS[version](con)
            con.execute("INSERT INTO schema_version VALUES (?, ?)", [version + 1, utcnow()])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
