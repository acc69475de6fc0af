"""The store's tables and how a file written by an older closedloop is brought up to date.

``MIGRATIONS[i]`` takes a file from version ``i`` to ``i + 1``; version 0 is an empty file, so
``MIGRATIONS[0]`` creates the first schema. Each step runs in its own transaction together with
the version bump, so a crash mid-migration leaves the file at the last complete version.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

import duckdb

from closedloop.store.records import utcnow

__all__ = ["SCHEMA_VERSION", "MIGRATIONS", "TABLES", "RUN_COLUMNS", "TURN_COLUMNS", "MESSAGE_COLUMNS",
           "TOOL_CALL_COLUMNS", "METRIC_COLUMNS", "TOKEN_IDS_REDACTED", "StoreVersionError", "migrate",
           "current_version", "version_on_file", "target_version", "arrow_types"]


class StoreVersionError(RuntimeError):
    """The file was written by a newer closedloop than this one."""


TOKEN_IDS_REDACTED = ("dropped by the run store: a credential was redacted from this turn's text or from the "
                      "conversation before it, and its token ids still encoded it")


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
        message JSON NOT NULL USING COMPRESSION zstd,
        prompt_ids INTEGER[],
        completion_ids INTEGER[],
        logprobs DOUBLE[],
        loss_mask TINYINT[],
        completion_text VARCHAR USING COMPRESSION zstd,
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


def _v1_to_v2(con: duckdb.DuckDBPyConnection) -> None:
    """Trainer-grade turns and per-step metrics.

    A turn now says how its logprobs were computed (``logprob_spec``), whether a trainer may use it
    (``trainable``, ``purpose``) and what its backend could not give (``unavailable``). Turns of an
    older file get the defaults ``Turn`` itself has (trainable policy turns, spec unknown), which is
    what they were. ``metrics`` is long-format (one row per run, step and name) so trainers can add
    a new metric without a migration.
    """
    con.execute("ALTER TABLE turns ADD COLUMN logprob_spec JSON")
    con.execute("ALTER TABLE turns ADD COLUMN trainable BOOLEAN DEFAULT true")
    con.execute("ALTER TABLE turns ADD COLUMN purpose VARCHAR DEFAULT 'policy'")
    con.execute("ALTER TABLE turns ADD COLUMN unavailable JSON")
    con.execute("""CREATE TABLE IF NOT EXISTS metrics (
        run_id VARCHAR NOT NULL,
        step BIGINT NOT NULL,
        name VARCHAR NOT NULL,
        value DOUBLE,
        created_at TIMESTAMP NOT NULL
    )""")


_TURNS_V3 = """CREATE TABLE turns_v3 (
        run_id VARCHAR NOT NULL,
        idx INTEGER NOT NULL,
        model VARCHAR,
        message JSON NOT NULL USING COMPRESSION zstd,
        prompt_ids BLOB USING COMPRESSION zstd,
        completion_ids BLOB USING COMPRESSION zstd,
        logprobs BLOB USING COMPRESSION zstd,
        loss_mask BLOB USING COMPRESSION zstd,
        completion_text VARCHAR USING COMPRESSION zstd,
        finish_reason VARCHAR,
        prompt_tokens BIGINT NOT NULL DEFAULT 0,
        completion_tokens BIGINT NOT NULL DEFAULT 0,
        cost_usd DOUBLE,
        latency_s DOUBLE,
        created_at TIMESTAMP NOT NULL,
        logprob_spec JSON,
        trainable BOOLEAN DEFAULT true,
        purpose VARCHAR DEFAULT 'policy',
        unavailable JSON
    )"""
_ARRAY_COLUMNS = ("prompt_ids", "completion_ids", "logprobs", "loss_mask")
_MIGRATION_CHUNK = 20_000
_MEDIA_MIGRATION_CHUNK = 256


def _v2_to_v3(con: duckdb.DuckDBPyConnection) -> None:
    """Token ids, logprobs and loss masks become compact BLOBs (layout: :mod:`closedloop.store.codec`),
    stored, like the message JSON and completion text, with zstd: measured on 1.4 kB of token ids
    per row, a bulk commit's checkpoint costs 2.5 µs per row with zstd and 10-16 µs with DuckDB's
    default dictionary + FSST analysis, and the file is smaller.

    DuckDB cannot reinterpret a list as bytes in SQL, so existing turns are copied through Python,
    ``_MIGRATION_CHUNK`` rows at a time in their original order, into a new table that then takes
    the old one's name. One-time cost: roughly what reading those turns back costs.
    """
    con.execute(_TURNS_V3)
    row = con.execute("SELECT max(rowid) FROM turns").fetchone()
    top = row[0] if row is not None else None
    cols = ", ".join(_TURN_COLUMNS_V3)
    if top is not None:  # a fresh file has nothing to copy and need not import pyarrow
        import pyarrow as pa

        from closedloop.store.codec import list_column_to_blob

        types = arrow_types()["turns"]
    for lo in range(0, -1 if top is None else top + 1, _MIGRATION_CHUNK):
        rows = con.execute(f"SELECT {cols} FROM turns WHERE rowid >= ? AND rowid < ? ORDER BY rowid",
                           [lo, lo + _MIGRATION_CHUNK]).fetchall()
        if not rows:
            continue
        columns = dict(zip(_TURN_COLUMNS_V3, map(list, zip(*rows))))
        for name in _ARRAY_COLUMNS:
            columns[name] = list_column_to_blob(columns[name], name)
        chunk = pa.table({c: pa.array(columns[c], type=types[c]) for c in _TURN_COLUMNS_V3})
        con.register("_closedloop_migrate_turns", chunk)
        try:
            con.execute(f"INSERT INTO turns_v3 ({cols}) SELECT {cols} FROM _closedloop_migrate_turns")
        finally:
            con.unregister("_closedloop_migrate_turns")
    con.execute("DROP TABLE turns")
    con.execute("ALTER TABLE turns_v3 RENAME TO turns")
    # Message JSON is zstd-compressed as well (DuckDB's default string compression, dictionary +
    # FSST, costs several times the CPU at every checkpoint of a bulk write).
    con.execute("""CREATE TABLE messages_v3 (
        run_id VARCHAR NOT NULL,
        idx INTEGER NOT NULL,
        role VARCHAR NOT NULL,
        json JSON NOT NULL USING COMPRESSION zstd
    )""")
    con.execute("INSERT INTO messages_v3 SELECT run_id, idx, role, json FROM messages ORDER BY rowid")
    con.execute("DROP TABLE messages")
    con.execute("ALTER TABLE messages_v3 RENAME TO messages")


def _v3_to_v4(con: duckdb.DuckDBPyConnection) -> None:
    """Media as artifacts (:mod:`closedloop.store.media`): the ``media`` and ``run_media`` tables,
    a ``turns.media`` column for each turn's content addresses (``Turn.media``), and every image or
    audio payload already inline in ``messages.json`` or ``turns.message`` moved out, rows a
    chunk at a time (only rows whose JSON has a media part are read), so the file holds no base64
    in message rows afterwards and reads restore the same parts as before."""
    from closedloop.store.media import MEDIA_TABLES, MediaSink, externalize_json, write_media

    con.execute("ALTER TABLE turns ADD COLUMN media JSON")
    for stmt in MEDIA_TABLES:
        con.execute(stmt)
    now = utcnow()
    for table, column in (("messages", "json"), ("turns", "message")):
        ids = [r[0] for r in con.execute(
            f"SELECT rowid FROM {table} WHERE contains({column}::VARCHAR, '\"image_url\"') OR "
            f"contains({column}::VARCHAR, '\"input_audio\"') ORDER BY rowid").fetchall()]
        for lo in range(0, len(ids), _MEDIA_MIGRATION_CHUNK):  # rows with media are big: a few at a time
            sink, updates, pairs = MediaSink(), [], set[tuple[str, str]]()
            for rowid, run_id, text in con.execute(
                    f"SELECT rowid, run_id, {column}::VARCHAR FROM {table} WHERE rowid IN "
                    "(SELECT unnest(?::BIGINT[]))", [ids[lo:lo + _MEDIA_MIGRATION_CHUNK]]).fetchall():
                moved = externalize_json(text, sink)
                if moved is not text:
                    updates.append((moved, rowid))
                    pairs.update((run_id, h) for h in sink.take())
            write_media(con, sink, pairs, now)
            if updates:
                con.executemany(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", updates)


def _v4_to_v5(con: duckdb.DuckDBPyConnection) -> None:
    """Metrics keyed by (run, step, name), and token ids of redacted text dropped.

    ``metrics`` gets a primary key, so a resumed trainer that logs a replayed step again
    replaces the row instead of adding a duplicate (writes use ``INSERT OR REPLACE``); rows
    already duplicated keep the latest (the value :meth:`RunStore.metrics` already showed).
    ``runs.secrets_redacted`` marks runs from whose messages or turns a credential was removed;
    their turns keep no token ids (they would decode back to the credential, see
    :func:`closedloop.store.batch.without_token_ids`). Runs of an older file are judged by the
    marker in their stored text, and all their turns lose their ids.
    """
    con.execute("""CREATE TABLE metrics_v5 (
        run_id VARCHAR NOT NULL,
        step BIGINT NOT NULL,
        name VARCHAR NOT NULL,
        value DOUBLE,
        created_at TIMESTAMP NOT NULL,
        PRIMARY KEY (run_id, step, name)
    )""")
    con.execute("INSERT INTO metrics_v5 SELECT run_id, step, name, value, created_at FROM metrics "
                "QUALIFY row_number() OVER (PARTITION BY run_id, step, name ORDER BY created_at DESC, rowid DESC) = 1")
    con.execute("DROP TABLE metrics")
    con.execute("ALTER TABLE metrics_v5 RENAME TO metrics")
    con.execute("ALTER TABLE runs ADD COLUMN secrets_redacted BOOLEAN DEFAULT false")
    con.execute("UPDATE runs SET secrets_redacted = true WHERE id IN ("
                "SELECT run_id FROM messages WHERE contains(json::VARCHAR, '[REDACTED]') UNION "
                "SELECT run_id FROM turns WHERE contains(message::VARCHAR, '[REDACTED]') "
                "OR contains(completion_text, '[REDACTED]'))")
    con.execute("UPDATE turns SET prompt_ids = NULL, completion_ids = NULL, logprobs = NULL, loss_mask = NULL, "
                "trainable = false, unavailable = json_merge_patch(coalesce(unavailable, '{}'), ?::JSON) "
                "WHERE run_id IN (SELECT id FROM runs WHERE secrets_redacted) "
                "AND (prompt_ids IS NOT NULL OR completion_ids IS NOT NULL)",
                [json.dumps({"token_ids": TOKEN_IDS_REDACTED})])


MIGRATIONS: list[Callable[[duckdb.DuckDBPyConnection], None]] = [_v0_to_v1, _v1_to_v2, _v2_to_v3, _v3_to_v4,
                                                                  _v4_to_v5]
TABLES = ("runs", "messages", "turns", "tool_calls", "metrics")
# ``turns`` as version 3 left it (the v2 -> v3 copy names exactly these).
_TURN_COLUMNS_V3 = ("run_id", "idx", "model", "message", "prompt_ids", "completion_ids", "logprobs", "loss_mask",
                    "completion_text", "finish_reason", "prompt_tokens", "completion_tokens", "cost_usd", "latency_s",
                    "created_at", "logprob_spec", "trainable", "purpose", "unavailable")
# Column order of ``turns`` after every migration (inserts name their columns, never rely on position).
TURN_COLUMNS = _TURN_COLUMNS_V3 + ("media",)
MESSAGE_COLUMNS = ("run_id", "idx", "role", "json")
TOOL_CALL_COLUMNS = ("run_id", "idx", "turn_idx", "call_id", "name", "arguments", "result", "error", "error_kind",
                     "latency_s", "created_at")
METRIC_COLUMNS = ("run_id", "step", "name", "value", "created_at")
# The columns a new run row is written with (the rest keep their defaults).
RUN_COLUMNS = ("id", "kind", "graph", "model_spec", "config", "status", "pid", "hostname", "proc_start", "parent_id",
               "closedloop_version", "started_at", "updated_at", "ended_at", "outcome", "error", "prompt_tokens",
               "completion_tokens", "cost_usd", "tags", "metadata", "secrets_redacted")


def _schema_version() -> int:
    return len(MIGRATIONS)


SCHEMA_VERSION = _schema_version()


def target_version() -> int:
    """The version this closedloop writes (read at call time so a test or plugin can append a step)."""
    return len(MIGRATIONS)


def version_on_file(con: duckdb.DuckDBPyConnection) -> int:
    """The file's version without writing (0 for a file without the version table); a file newer
    than this closedloop raises :class:`StoreVersionError`."""
    if not con.execute("SELECT 1 FROM duckdb_tables() WHERE table_name = 'schema_version' AND "
                       "schema_name = 'main'").fetchone():
        return 0
    row = con.execute("SELECT max(version) FROM schema_version").fetchone()
    version = int(row[0]) if row and row[0] is not None else 0
    _refuse_newer(version, target_version())
    return version


def _refuse_newer(version: int, target: int) -> None:
    if version > target:
        raise StoreVersionError(f"run store schema is version {version}, but this closedloop knows only "
                                f"up to {target}; upgrade closedloop to read it")


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
            _refuse_newer(version, target)
            if version == target:
                con.execute("COMMIT")
                return version
            MIGRATIONS[version](con)
            con.execute("INSERT INTO schema_version VALUES (?, ?)", [version + 1, utcnow()])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise


@functools.lru_cache(maxsize=1)
def arrow_types() -> dict[str, dict[str, Any]]:
    """Each table's columns as Arrow types: the types a bulk insert (:class:`~closedloop.store.batch.Rows`)
    and the v2 -> v3 migration hand DuckDB. pyarrow is imported on the first call."""
    import pyarrow as pa

    ts = pa.timestamp("us")
    return {
        "runs": {"id": pa.string(), "kind": pa.string(), "graph": pa.string(), "model_spec": pa.string(),
                 "config": pa.string(), "status": pa.string(), "pid": pa.int32(), "hostname": pa.string(),
                 "proc_start": pa.int64(), "parent_id": pa.string(), "closedloop_version": pa.string(),
                 "started_at": ts, "updated_at": ts, "ended_at": ts, "outcome": pa.string(), "error": pa.string(),
                 "prompt_tokens": pa.int64(), "completion_tokens": pa.int64(), "cost_usd": pa.float64(),
                 "tags": pa.list_(pa.string()), "metadata": pa.string(), "secrets_redacted": pa.bool_()},
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
