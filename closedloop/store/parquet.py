"""Every table as a Parquet file, written from one read transaction (one consistent snapshot).

Most tables are copied by DuckDB itself (``COPY ... TO``). Two are streamed through Arrow one
record batch at a time instead: ``turns``, whose token-id, logprob and loss-mask BLOBs
(:mod:`closedloop.store.codec`) go out as the lists they encode (what a Parquet reader expects),
and, with ``media="inline"``, ``messages``, whose JSON gets its media references replaced by the
recorded parts, so each file stands alone. With ``media="refs"`` the references stay and
``media.parquet`` holds each blob once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import duckdb

from closedloop.store.codec import turn_arrays_to_lists
from closedloop.store.media import MediaMode, Restorer, fetch_media, referenced_hashes
from closedloop.store.schema import TABLES

__all__ = ["parquet_paths", "write_parquet"]

_BATCH_ROWS = 20_000
Columns = dict[str, Any]  # column name -> pyarrow array


def parquet_paths(directory: Path, media: MediaMode) -> dict[str, Path]:
    """The file of each exported table (``media.parquet`` only with ``media="refs"``)."""
    tables = TABLES + (("media",) if media == "refs" else ())
    return {t: (directory / f"{t}.parquet").resolve() for t in tables}


def write_parquet(con: duckdb.DuckDBPyConnection, paths: dict[str, Path], media: MediaMode) -> dict[str, Path]:
    """Write each table of ``paths`` to its file (in the caller's read transaction); returns ``paths``."""
    # Media rows are immutable, so a second cursor may look them up while a table streams.
    has_media = media == "inline" and con.execute("SELECT count(*) FROM (SELECT 1 FROM run_media LIMIT 1)").fetchone()
    lookup = con.cursor() if has_media and has_media[0] else None
    try:
        for table, path in paths.items():
            if table == "turns":
                _stream(con, "turns", path, lambda columns: _turn_columns(columns, lookup))
            elif table == "messages" and lookup is not None:
                _stream(con, "messages", path, lambda columns: {**columns, "json": _restored(columns["json"], lookup)})
            else:
                query = (f"SELECT * FROM {table} ORDER BY ALL" if table != "media" else  # each hash once
                         "SELECT sha256, any_value(mime) AS mime, any_value(size) AS size, "
                         "any_value(data) AS data, min(created_at) AS created_at FROM media "
                         "GROUP BY sha256 ORDER BY sha256")
                quoted = str(path).replace("'", "''")
                con.execute(f"COPY ({query}) TO '{quoted}' (FORMAT parquet)")
    finally:
        if lookup is not None:
            lookup.close()
    return paths


def _turn_columns(columns: Columns, lookup: duckdb.DuckDBPyConnection | None) -> Columns:
    """``turns`` columns as exported: the array BLOBs as lists, ``message`` with its media restored (``lookup``)."""
    columns = {**columns, **turn_arrays_to_lists(columns)}
    if lookup is not None:
        columns["message"] = _restored(columns["message"], lookup)
    return columns


def _restored(values: Any, lookup: duckdb.DuckDBPyConnection) -> Any:
    """A string column of message JSON with its media references replaced by the payloads."""
    import pyarrow as pa

    texts = values.to_pylist()
    hashes = referenced_hashes(texts)
    if hashes:
        restore = Restorer(fetch_media(lookup, hashes))
        texts = [restore(t) if t is not None else None for t in texts]
    return pa.array(texts, type=pa.string())


def _stream(con: duckdb.DuckDBPyConnection, table: str, path: Path, transform: Callable[[Columns], Columns]) -> None:
    """``table`` as Parquet, one record batch at a time, each batch's columns through ``transform``
    (an empty table still gives a file with the transformed schema)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    reader = con.sql(f"SELECT * FROM {table} ORDER BY ALL").to_arrow_reader(_BATCH_ROWS)
    writer = None
    try:  # the reader is closed here, never left to keep the database open past the store's lock
        for batch in reader:
            out = pa.table(transform({name: batch.column(name) for name in batch.schema.names}))
            if writer is None:
                writer = pq.ParquetWriter(str(path), out.schema)
            writer.write_table(out)
        if writer is None:
            empty = {name: pa.array([], type=f.type) for name, f in zip(reader.schema.names, reader.schema)}
            pq.write_table(pa.table(transform(empty)), str(path))
    finally:
        reader.close()
        if writer is not None:
            writer.close()
