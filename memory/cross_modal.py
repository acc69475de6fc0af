"""Text-centric cross-modal memory (LLM Orchestration, paper 4).

Every expert output becomes a structured text record: which modality it read, the content hash of
the source (an image's, an audio clip's sha256), which expert produced it, for which query, when,
and a text summary (plus an optional embedding). Later turns retrieve records instead of calling
the expert again: by source (and expert and query) for "the same question about the same image",
by text for "what do we know about X".

Records live in DuckDB (a file shared by sessions, or ``:memory:``), so memory survives restarts
and can be inspected with SQL. Retrieval by text ranks records by how many query words their
summary and query contain, weighted by inverse document frequency: enough for a memory of a
conversation's expert outputs, with no index to maintain.
"""

from __future__ import annotations

import json
import math
import re
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["MemoryRecord", "CrossModalMemory", "normalise_query"]

Modality = Literal["image", "audio", "video", "text"]
_WORD = re.compile(r"\w+", re.UNICODE)


def normalise_query(text: str) -> str:
    """Case, punctuation and spacing do not make a question new."""
    return " ".join(_WORD.findall(text.lower()))


class MemoryRecord(BaseModel):
    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    modality: Modality
    source: str | None = None  # sha256 of the source content (None: no source, e.g. a text expert)
    expert: str
    query: str
    summary: str
    created_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))
    embedding: list[float] | None = None


class CrossModalMemory:
    """Expert outputs as text records in DuckDB."""

    def __init__(self, path: str | Path = ":memory:") -> None:
        import duckdb

        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._con = duckdb.connect(self.path)
        self._lock = threading.Lock()
        self._con.execute("""CREATE TABLE IF NOT EXISTS memory (
            id VARCHAR PRIMARY KEY, modality VARCHAR NOT NULL, source VARCHAR, expert VARCHAR NOT NULL,
            query VARCHAR NOT NULL, query_norm VARCHAR NOT NULL, summary VARCHAR NOT NULL,
            created_at TIMESTAMPTZ NOT NULL, embedding VARCHAR)""")
        #: Lookups answered from memory, and records added: what a memory hit saves is visible.
        self.hits = 0
        self.added = 0

    def add(self, record: MemoryRecord) -> MemoryRecord:
        with self._lock:
            self._con.execute("INSERT INTO memory VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                              [record.id, record.modality, record.source, record.expert, record.query,
                               normalise_query(record.query), record.summary, record.created_at,
                               json.dumps(record.embedding) if record.embedding is not None else None])
            self.added += 1
        return record

    def _rows(self, sql: str, params: list) -> list[MemoryRecord]:
        with self._lock:
            rows = self._con.execute(sql, params).fetchall()
        return [MemoryRecord(id=r[0], modality=r[1], source=r[2], expert=r[3], query=r[4], summary=r[6],
                             created_at=r[7], embedding=json.loads(r[8]) if r[8] else None) for r in rows]

    def lookup(self, source: str | None, *, expert: str | None = None, query: str | None = None) -> MemoryRecord | None:
        """The newest record of this source (and expert, and question up to case/punctuation)."""
        where, params = ["source IS NOT DISTINCT FROM ?"], [source]
        if expert is not None:
            where.append("expert = ?")
            params.append(expert)
        if query is not None:
            where.append("query_norm = ?")
            params.append(normalise_query(query))
        found = self._rows(f"SELECT * FROM memory WHERE {' AND '.join(where)} ORDER BY created_at DESC LIMIT 1",
                           params)
        if found:
            self.hits += 1
            return found[0]
        return None

    def by_source(self, source: str) -> list[MemoryRecord]:
        return self._rows("SELECT * FROM memory WHERE source = ? ORDER BY created_at", [source])

    def search(self, text: str, k: int = 5) -> list[MemoryRecord]:
        """Records whose summary or query share words with ``text``, best first (IDF-weighted overlap)."""
        words = set(normalise_query(text).split())
        if not words:
            return []
        records = self._rows("SELECT * FROM memory ORDER BY created_at", [])
        docs = [set(normalise_query(f"{r.query} {r.summary}").split()) for r in records]
        n = len(docs)
        scored = []
        for r, d in zip(records, docs):
            s = sum(math.log(1 + n / (1 + sum(w in x for x in docs))) for w in words & d)
            if s > 0:
                scored.append((s, r.created_at, r))
        scored.sort(key=lambda x: (-x[0], x[1]))
        return [r for _, _, r in scored[:k]]

    def __len__(self) -> int:
        with self._lock:
            row = self._con.execute("SELECT count(*) FROM memory").fetchone()
        assert row is not None  # an aggregate without GROUP BY always returns one row
        return int(row[0])

    def close(self) -> None:
        self._con.close()
