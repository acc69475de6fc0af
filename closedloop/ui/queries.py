"""The viewer's reads that ``RunStore``'s public methods do not offer (a filtered, paged runs list
with facets, a change fingerprint for live refresh, a run's children and steps, one media blob
with its type).

Every read goes through :func:`read`: one short transaction on the store's file, opened and
closed the way the store opens it for its own reads, so a writer in another process waits at
most the few milliseconds a read holds the file, and never a viewer's whole page. Nothing here
writes. Runs, turns and metrics read through ``RunStore`` itself (``get_run``, ``metrics``,
``list_runs``) wherever it has a method for them.
"""

from __future__ import annotations

import json
from datetime import date, datetime, timedelta
from typing import Any, Callable, Literal, TypeVar

import duckdb
from pydantic import BaseModel, Field, field_validator

from closedloop.store import TERMINAL_STATUSES, RunStore

__all__ = ["read", "RunFilter", "RunRow", "Facets", "RunsPage", "runs_page", "fingerprint", "Children", "children",
           "child_steps", "media", "STATUSES"]

T = TypeVar("T")
STATUSES = ("running",) + TERMINAL_STATUSES
PAGE_SIZE = 50


def read(store: RunStore, fn: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
    """Run ``fn`` (which only reads) through :meth:`RunStore.read`: a shared lock and a read-only
    connection, released as soon as ``fn`` returns, so a writer in another process is never held."""
    return store.read(fn)


class RunFilter(BaseModel):
    """The runs page's query string, validated (an unknown status or a bad date is a 400)."""

    kind: str | None = None
    graph: str | None = None
    model: str | None = None
    status: str | None = None
    tag: str | None = None
    since: date | None = None
    until: date | None = None
    q: str | None = Field(default=None, max_length=200)
    scope: Literal["top", "all"] = "top"
    page: int = Field(default=0, ge=0, le=100_000)

    @field_validator("kind", "graph", "model", "status", "tag", "q", "since", "until", mode="before")
    @classmethod
    def _blank_is_none(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("status")
    @classmethod
    def _known_status(cls, v: str | None) -> str | None:
        if v is not None and v not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}")
        return v

    def where(self) -> tuple[str, list[Any]]:
        """SQL ``WHERE`` clause (possibly empty) and its parameters; user text only ever as parameters."""
        clauses: list[str] = []
        params: list[Any] = []
        for column, value in (("kind", self.kind), ("graph", self.graph), ("model_spec", self.model),
                              ("status", self.status)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if self.tag is not None:
            clauses.append("list_contains(tags, ?)")
            params.append(self.tag)
        if self.since is not None:
            clauses.append("started_at >= ?")
            params.append(datetime.combine(self.since, datetime.min.time()))
        if self.until is not None:
            clauses.append("started_at < ?")
            params.append(datetime.combine(self.until + timedelta(days=1), datetime.min.time()))
        if self.scope == "top" and not self._narrowed():
            clauses.append("parent_id IS NULL")
        if self.q is not None:
            # Case-insensitive substring over what identifies a run; messages are not scanned (a
            # million turns would make every keystroke a full scan).
            clauses.append("(starts_with(id, ?) OR contains(lower(concat_ws(' ', kind, graph, model_spec, "
                           "array_to_string(tags, ' '), error, CAST(metadata AS VARCHAR), CAST(config AS VARCHAR))), ?))")
            params += [self.q.lower(), self.q.lower()]
        return ("WHERE " + " AND ".join(clauses)) if clauses else "", params

    def _narrowed(self) -> bool:
        """A search or a tag finds child runs too: an episode is usually what one looks for."""
        return self.q is not None or self.tag is not None

    def query(self, **changes: Any) -> dict[str, str]:
        """The filter as query-string pairs (for links that change one field)."""
        values = {**self.model_dump(exclude_defaults=True, mode="json"), **changes}
        return {k: str(v) for k, v in values.items() if v not in (None, "", 0) or k == "page" and v}


class RunRow(BaseModel):
    id: str
    kind: str
    graph: str | None
    model_spec: str | None
    status: str
    parent_id: str | None
    started_at: datetime
    ended_at: datetime | None
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float | None
    tags: list[str]
    rewards: dict[str, float]
    children: int
    error: str | None

    @property
    def duration_s(self) -> float | None:
        return None if self.ended_at is None else (self.ended_at - self.started_at).total_seconds()


class Facets(BaseModel):
    """Distinct values (with run counts) for the filter menus, over the whole store."""

    kind: list[tuple[str, int]] = Field(default_factory=list)
    graph: list[tuple[str, int]] = Field(default_factory=list)
    model: list[tuple[str, int]] = Field(default_factory=list)
    status: list[tuple[str, int]] = Field(default_factory=list)
    tag: list[tuple[str, int]] = Field(default_factory=list)


class RunsPage(BaseModel):
    version: str  # the store's fingerprint, read in the same transaction as the rows
    rows: list[RunRow]
    total: int
    facets: Facets
    page: int
    page_size: int

    @property
    def has_next(self) -> bool:
        return (self.page + 1) * self.page_size < self.total


_FACET_LIMIT = 200


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any]) -> tuple[Any, ...]:
    """The single row of an aggregate query."""
    row = con.execute(sql, params).fetchone()
    if row is None:
        raise RuntimeError(f"no row from {sql!r}")
    return row


def _rewards(raw: Any) -> dict[str, float]:
    value = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(value, dict):
        return {}
    out = {}
    for k, v in value.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[str(k)] = float(v)
    return out


def runs_page(store: RunStore, f: RunFilter, page_size: int = PAGE_SIZE) -> RunsPage:
    """One page of runs, newest first, with the total and the facets: one transaction."""
    where, params = f.where()

    def q(con: duckdb.DuckDBPyConnection) -> RunsPage:
        version = _fingerprint(con)
        total = _one(con, f"SELECT count(*) FROM runs {where}", params)[0]
        rows = con.execute(
            "WITH page AS (SELECT id, kind, graph, model_spec, status, parent_id, started_at, ended_at, prompt_tokens, "
            "completion_tokens, cost_usd, tags, json_extract(outcome, '$.rewards') AS rewards, "
            f"left(error, 300) AS error FROM runs {where} ORDER BY started_at DESC, id LIMIT ? OFFSET ?) "
            "SELECT page.*, coalesce(c.n, 0) FROM page LEFT JOIN (SELECT parent_id AS pid, count(*) AS n FROM runs "
            "WHERE parent_id IN (SELECT id FROM page) GROUP BY parent_id) c ON c.pid = page.id "
            "ORDER BY page.started_at DESC, page.id", params + [page_size, f.page * page_size]).fetchall()
        facets = Facets()
        for name, expr in (("kind", "kind"), ("graph", "graph"), ("model", "model_spec"), ("status", "status")):
            got = con.execute(f"SELECT {expr}, count(*) FROM runs WHERE {expr} IS NOT NULL GROUP BY ALL "
                              f"ORDER BY count(*) DESC, 1 LIMIT {_FACET_LIMIT}").fetchall()
            setattr(facets, name, [(str(v), int(n)) for v, n in got])
        facets.tag = [(str(v), int(n)) for v, n in con.execute(
            "SELECT t, count(*) FROM (SELECT unnest(tags) AS t FROM runs) GROUP BY t "
            f"ORDER BY count(*) DESC, t LIMIT {_FACET_LIMIT}").fetchall()]
        out = []
        for (rid, kind, graph, spec, status, parent, started, ended, p_tok, c_tok, cost, tags, rewards, error,
             n_children) in rows:
            out.append(RunRow(id=rid, kind=kind, graph=graph, model_spec=spec, status=status, parent_id=parent,
                              started_at=started, ended_at=ended, prompt_tokens=p_tok, completion_tokens=c_tok,
                              cost_usd=cost, tags=list(tags or []), rewards=_rewards(rewards), children=int(n_children),
                              error=error))
        return RunsPage(version=version, rows=out, total=int(total), facets=facets, page=f.page, page_size=page_size)

    return read(store, q)


def _fingerprint(con: duckdb.DuckDBPyConnection) -> str:
    n, last = _one(con, "SELECT count(*), max(updated_at) FROM runs", [])
    return f"{n}:{last.isoformat() if last else '-'}"


def fingerprint(store: RunStore) -> str:
    """Changes whenever anything is written: every write adds a run or moves some run's
    ``updated_at`` (turns, steps, metrics, finishing). One cheap aggregate over ``runs``."""
    return read(store, _fingerprint)


class Children(BaseModel):
    version: str  # the store's fingerprint, read first in the same transaction
    rows: list[RunRow]
    total: int


def children(store: RunStore, parent_id: str, *, limit: int = 500) -> Children:
    """The first ``limit`` child runs of a run (oldest first), how many there are in all, and the
    store's fingerprint before them. Without configs and outcomes: a τ-bench episode's outcome
    holds its whole simulation. ``parent_id`` may be a unique prefix, as everywhere."""

    def q(con: duckdb.DuckDBPyConnection) -> Children:
        version = _fingerprint(con)
        ids = [r[0] for r in con.execute("SELECT id FROM runs WHERE id = ? UNION ALL (SELECT id FROM runs "
                                         "WHERE starts_with(id, ?) LIMIT 2)", [parent_id, parent_id]).fetchall()]
        full = ids[0] if ids and (ids[0] == parent_id or len(set(ids)) == 1) else parent_id
        total = _one(con, "SELECT count(*) FROM runs WHERE parent_id = ?", [full])[0]
        rows = con.execute(
            "SELECT id, kind, graph, model_spec, status, parent_id, started_at, ended_at, prompt_tokens, "
            "completion_tokens, cost_usd, tags, json_extract(outcome, '$.rewards'), left(error, 300) "
            "FROM runs WHERE parent_id = ? ORDER BY started_at, rowid LIMIT ?", [full, limit]).fetchall()
        out = [RunRow(id=r[0], kind=r[1], graph=r[2], model_spec=r[3], status=r[4], parent_id=r[5], started_at=r[6],
                      ended_at=r[7], prompt_tokens=r[8], completion_tokens=r[9], cost_usd=r[10], tags=list(r[11] or []),
                      rewards=_rewards(r[12]), children=0, error=r[13]) for r in rows]
        return Children(version=version, rows=out, total=int(total))

    return read(store, q)


def child_steps(store: RunStore, parent_id: str) -> list[int]:
    """Training steps that have rollouts (children tagged ``step:N``), ascending."""

    def q(con: duckdb.DuckDBPyConnection) -> list[int]:
        tags = con.execute("SELECT DISTINCT t FROM (SELECT unnest(tags) AS t FROM runs WHERE parent_id = ?) "
                           "WHERE starts_with(t, 'step:')", [parent_id]).fetchall()
        steps = []
        for (t,) in tags:
            try:
                steps.append(int(t[len("step:"):]))
            except ValueError:
                continue
        return sorted(steps)

    return read(store, q)


def media(store: RunStore, sha256: str) -> tuple[str | None, bytes] | None:
    """One stored image/audio: (recorded MIME type, bytes), or None when the store has no such hash."""

    def q(con: duckdb.DuckDBPyConnection) -> tuple[str | None, bytes] | None:
        row = con.execute("SELECT any_value(mime), any_value(data) FROM media WHERE sha256 = ?", [sha256]).fetchone()
        return None if row is None or row[1] is None else (row[0], bytes(row[1]))

    return read(store, q)
