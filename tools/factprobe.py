"""FactProbe (FactGuard, paper 1): evidence search behind one interface, summarised into a report.

The paper's FactProbe queries a web search engine (Serper), keeps organic results only, excludes
social-media hosts, and summarises title, snippet and link into a text report for the agent.
Here one :class:`SearchBackend` interface has:

* :class:`LocalCorpus` (the default, offline): documents in a DuckDB file, ranked by Okapi BM25
  (k1 = 1.2, b = 0.75, Lucene's IDF ``ln(1 + (N - df + 0.5) / (df + 0.5))``: the same formula as
  DuckDB's ``fts`` extension's ``match_bm25``). The scoring is written as SQL over a postings
  table in the same file, not through the ``fts`` extension, because that extension is
  downloaded at ``LOAD`` time from extensions.duckdb.org and no build of it exists for the
  DuckDB release pinned here: an offline tool cannot depend on it.
* Web backends, used when a key or URL is configured: :class:`SerperBackend`,
  :class:`TavilyBackend`, :class:`BraveBackend`, :class:`SearxNGBackend`, each speaking its
  service's documented HTTP API (tested against a local server that speaks it).

Every backend's results pass the same filter (social-media hosts dropped, as in the paper) and
become the same report (:func:`report`). :func:`backend_from_env` picks one from the environment.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import unicodedata
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Annotated, Any, Iterable
from urllib.parse import urlparse

from pydantic import BaseModel, Field

from closedloop.tool import Tool

__all__ = ["SearchResult", "SearchBackend", "LocalCorpus", "SerperBackend", "TavilyBackend", "BraveBackend",
           "SearxNGBackend", "SOCIAL_MEDIA_HOSTS", "is_social_media", "report", "tokenize", "backend_from_env",
           "make_factprobe_tool", "SearchError"]

#: Hosts whose pages are user posts, not evidence (the paper excludes social media).
SOCIAL_MEDIA_HOSTS = ("youtube.com", "youtu.be", "tiktok.com", "douyin.com", "kuaishou.com", "bilibili.com",
                      "weibo.com", "weibo.cn", "facebook.com", "fb.com", "instagram.com", "twitter.com", "x.com",
                      "reddit.com", "threads.net", "snapchat.com", "pinterest.com", "linkedin.com", "vk.com",
                      "xiaohongshu.com", "ixigua.com", "t.me", "telegram.org")


class SearchError(RuntimeError):
    """A search backend failed (HTTP error, bad answer); the message says which and why."""


class SearchResult(BaseModel):
    title: str
    snippet: str
    link: str
    score: float | None = None


def is_social_media(link: str) -> bool:
    host = (urlparse(link).hostname or "").lower()
    return any(host == h or host.endswith("." + h) for h in SOCIAL_MEDIA_HOSTS)


def report(query: str, results: Iterable[SearchResult], *, max_snippet: int = 300) -> str:
    """The text the agent reads: one numbered entry per result (title, snippet, link)."""
    results = list(results)
    if not results:
        return f'FactProbe found no evidence for "{query}".'
    lines = [f'FactProbe evidence for "{query}" ({len(results)} result{"s" if len(results) != 1 else ""}):']
    for i, r in enumerate(results, 1):
        snippet = " ".join(r.snippet.split())
        if len(snippet) > max_snippet:
            snippet = snippet[:max_snippet].rstrip() + "…"
        lines.append(f"[{i}] {r.title.strip()}\n    {snippet}\n    source: {r.link}")
    return "\n".join(lines)


class SearchBackend(ABC):
    """Organic results for a query, best first."""

    name: str = "search"

    @abstractmethod
    def raw_search(self, query: str, k: int) -> list[SearchResult]:
        ...

    def search(self, query: str, k: int = 5) -> list[SearchResult]:
        """Up to ``k`` results with social-media hosts removed (asks the backend for a few more)."""
        if not query.strip():
            raise ValueError("the search query is empty")
        if k < 1:
            raise ValueError("k must be >= 1")
        kept = [r for r in self.raw_search(query, k + 5) if not is_social_media(r.link)]
        return kept[:k]


# ------------------------------------------------------------------ offline corpus

_TOKEN = re.compile(r"\w+", re.UNICODE)


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens, accents stripped (DuckDB fts's default ``strip_accents``/``lower``)."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    return _TOKEN.findall(text.lower())


class LocalCorpus(SearchBackend):
    """A document collection in a DuckDB file, BM25-ranked.

    Documents are JSON objects with ``text`` and optional ``id``, ``title``, ``url``; title and text
    are both indexed. Build once (:meth:`build`), search many times; the file can be shared.
    """

    name = "local"

    def __init__(self, path: str | Path, *, k1: float = 1.2, b: float = 0.75) -> None:
        import duckdb

        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"corpus index not found: {self.path} (build it with LocalCorpus.build)")
        self.k1, self.b = k1, b
        self._con = duckdb.connect(str(self.path), read_only=True)
        self._lock = threading.Lock()

    @classmethod
    def build(cls, path: str | Path, docs: Iterable[dict[str, Any]], **kwargs: Any) -> "LocalCorpus":
        """Index ``docs`` into a new DuckDB file at ``path`` (replaced if present)."""
        import duckdb

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            path.unlink()
        rows: list[tuple[int, str, str, str, str, int]] = []
        postings: list[tuple[str, int, int]] = []
        for i, d in enumerate(docs):
            if not isinstance(d, dict) or not isinstance(d.get("text"), str):
                raise ValueError(f"document {i}: needs a 'text' string")
            doc_id = str(d.get("id", i))
            title, url = str(d.get("title") or ""), str(d.get("url") or f"local://{doc_id}")
            terms = tokenize(f"{title} {d['text']}")
            rows.append((i, doc_id, title, d["text"], url, len(terms)))
            counts: dict[str, int] = {}
            for t in terms:
                counts[t] = counts.get(t, 0) + 1
            postings.extend((t, i, c) for t, c in counts.items())
        if not rows:
            raise ValueError("no documents to index")
        con = duckdb.connect(str(path))
        try:
            con.execute("CREATE TABLE docs (docno INTEGER PRIMARY KEY, id VARCHAR, title VARCHAR, text VARCHAR, "
                        "url VARCHAR, len INTEGER)")
            con.execute("CREATE TABLE postings (term VARCHAR, docno INTEGER, tf INTEGER)")
            con.executemany("INSERT INTO docs VALUES (?, ?, ?, ?, ?, ?)", rows)
            con.executemany("INSERT INTO postings VALUES (?, ?, ?)", postings)
            con.execute("CREATE TABLE stats AS SELECT count(*) AS n, avg(len) AS avgdl FROM docs")
        finally:
            con.close()
        return cls(path, **kwargs)

    @classmethod
    def from_jsonl(cls, index_path: str | Path, jsonl: str | Path, **kwargs: Any) -> "LocalCorpus":
        docs = []
        for no, line in enumerate(Path(jsonl).read_text().splitlines(), 1):
            if line.strip():
                try:
                    docs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{jsonl}:{no}: not JSON: {e}") from None
        return cls.build(index_path, docs, **kwargs)

    def scores(self, query: str) -> dict[int, float]:
        """BM25 score of every document matching at least one query term (docno -> score)."""
        terms = tokenize(query)
        if not terms:
            return {}
        sql = """
            WITH q AS (SELECT unnest(?::VARCHAR[]) AS term),
                 df AS (SELECT term, count(*) AS df FROM postings WHERE term IN (SELECT term FROM q) GROUP BY term)
            SELECT p.docno,
                   sum(ln(1 + (s.n - df.df + 0.5) / (df.df + 0.5))
                       * p.tf * (? + 1) / (p.tf + ? * (1 - ? + ? * d.len / s.avgdl))) AS score
            FROM q JOIN postings p USING (term) JOIN df USING (term) JOIN docs d USING (docno), stats s
            GROUP BY p.docno"""
        with self._lock:
            rows = self._con.execute(sql, [terms, self.k1, self.k1, self.b, self.b]).fetchall()
        return {int(d): float(s) for d, s in rows}

    def raw_search(self, query: str, k: int) -> list[SearchResult]:
        scored = sorted(self.scores(query).items(), key=lambda x: (-x[1], x[0]))[:k]
        if not scored:
            return []
        with self._lock:
            docs = {r[0]: r for r in self._con.execute(
                "SELECT docno, title, text, url FROM docs WHERE docno IN (SELECT unnest(?::INTEGER[]))",
                [[d for d, _ in scored]]).fetchall()}
        return [SearchResult(title=docs[d][1] or docs[d][3][:60], snippet=docs[d][2], link=docs[d][3], score=s)
                for d, s in scored]

    def close(self) -> None:
        self._con.close()


# ------------------------------------------------------------------ web backends


class _HTTPBackend(SearchBackend):
    timeout_s = 20.0

    def _request(self, method: str, url: str, **kwargs: Any) -> Any:
        import httpx

        try:
            r = httpx.request(method, url, timeout=self.timeout_s, **kwargs)
        except httpx.HTTPError as e:
            raise SearchError(f"{self.name}: request to {urlparse(url).netloc} failed: {type(e).__name__}") from None
        if r.status_code != 200:
            raise SearchError(f"{self.name}: HTTP {r.status_code} from {urlparse(url).netloc}: {r.text[:200]}")
        try:
            return r.json()
        except ValueError:
            raise SearchError(f"{self.name}: the answer is not JSON") from None


class SerperBackend(_HTTPBackend):
    """google.serper.dev: ``POST /search`` with ``X-API-KEY``; ``organic[]`` of title/link/snippet."""

    name = "serper"

    def __init__(self, api_key: str, base_url: str = "https://google.serper.dev") -> None:
        self.api_key, self.base_url = api_key, base_url.rstrip("/")

    def raw_search(self, query: str, k: int) -> list[SearchResult]:
        data = self._request("POST", f"{self.base_url}/search", json={"q": query, "num": k},
                             headers={"X-API-KEY": self.api_key, "Content-Type": "application/json"})
        return [SearchResult(title=o.get("title", ""), snippet=o.get("snippet", ""), link=o.get("link", ""))
                for o in data.get("organic", []) if o.get("link")]


class TavilyBackend(_HTTPBackend):
    """api.tavily.com: ``POST /search`` with a Bearer key; ``results[]`` of title/url/content."""

    name = "tavily"

    def __init__(self, api_key: str, base_url: str = "https://api.tavily.com") -> None:
        self.api_key, self.base_url = api_key, base_url.rstrip("/")

    def raw_search(self, query: str, k: int) -> list[SearchResult]:
        data = self._request("POST", f"{self.base_url}/search", json={"query": query, "max_results": k},
                             headers={"Authorization": f"Bearer {self.api_key}"})
        return [SearchResult(title=o.get("title", ""), snippet=o.get("content", ""), link=o.get("url", ""),
                             score=o.get("score")) for o in data.get("results", []) if o.get("url")]


class BraveBackend(_HTTPBackend):
    """api.search.brave.com: ``GET /res/v1/web/search`` with ``X-Subscription-Token``; ``web.results[]``."""

    name = "brave"

    def __init__(self, api_key: str, base_url: str = "https://api.search.brave.com") -> None:
        self.api_key, self.base_url = api_key, base_url.rstrip("/")

    def raw_search(self, query: str, k: int) -> list[SearchResult]:
        data = self._request("GET", f"{self.base_url}/res/v1/web/search", params={"q": query, "count": min(k, 20)},
                             headers={"X-Subscription-Token": self.api_key, "Accept": "application/json"})
        return [SearchResult(title=o.get("title", ""), snippet=o.get("description", ""), link=o.get("url", ""))
                for o in (data.get("web") or {}).get("results", []) if o.get("url")]


class SearxNGBackend(_HTTPBackend):
    """A SearxNG instance: ``GET /search?format=json``; ``results[]`` of title/url/content."""

    name = "searxng"

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def raw_search(self, query: str, k: int) -> list[SearchResult]:
        data = self._request("GET", f"{self.base_url}/search", params={"q": query, "format": "json"})
        return [SearchResult(title=o.get("title", ""), snippet=o.get("content", ""), link=o.get("url", ""),
                             score=o.get("score")) for o in data.get("results", [])[:k] if o.get("url")]


def backend_from_env(corpus: str | Path | None = None, env: dict[str, str] | None = None) -> SearchBackend:
    """``CLOSEDLOOP_SEARCH`` = local | serper | tavily | brave | searxng (default: local, or the
    first web service whose key/URL is set). Keys: ``SERPER_API_KEY``, ``TAVILY_API_KEY``,
    ``BRAVE_API_KEY``; ``SEARXNG_URL``. The local corpus: ``corpus`` or ``CLOSEDLOOP_SEARCH_CORPUS``."""
    env = dict(os.environ if env is None else env)
    choice = env.get("CLOSEDLOOP_SEARCH", "").lower()
    keys = {"serper": "SERPER_API_KEY", "tavily": "TAVILY_API_KEY", "brave": "BRAVE_API_KEY", "searxng": "SEARXNG_URL"}
    if not choice:
        choice = "local" if (corpus or env.get("CLOSEDLOOP_SEARCH_CORPUS")) else next(
            (name for name, var in keys.items() if env.get(var)), "local")
    if choice == "local":
        path = corpus or env.get("CLOSEDLOOP_SEARCH_CORPUS")
        if not path:
            raise ValueError("FactProbe: no search backend configured (set CLOSEDLOOP_SEARCH_CORPUS to a corpus "
                             "index, or a web search key such as SERPER_API_KEY)")
        return LocalCorpus(path)
    if choice not in keys:
        raise ValueError(f"CLOSEDLOOP_SEARCH={choice!r}: expected one of local, {', '.join(keys)}")
    value = env.get(keys[choice])
    if not value:
        raise ValueError(f"CLOSEDLOOP_SEARCH={choice} needs {keys[choice]}")
    base = env.get(f"{choice.upper()}_BASE_URL")
    if choice == "searxng":
        return SearxNGBackend(value)
    keyed: dict[str, type[SerperBackend | TavilyBackend | BraveBackend]] = {
        "serper": SerperBackend, "tavily": TavilyBackend, "brave": BraveBackend}
    cls = keyed[choice]
    return cls(value, base) if base else cls(value)


def make_factprobe_tool(backend: SearchBackend, *, k: int = 5, name: str = "factprobe") -> Tool:
    """FactProbe as a tool: a query in, the evidence report out. No call limit (as in the paper)."""

    def factprobe(query: Annotated[str, Field(min_length=1, max_length=500)]) -> str:
        """Search for evidence about a claim (news, fact checks, official sources; social media excluded) and get a short report.

        Args:
            query: What to search for, e.g. the claim or the event in the video.
        """
        return report(query, backend.search(query, k))

    return Tool(factprobe, name=name, timeout_s=60.0)


def _idf(n: int, df: int) -> float:  # for readers and tests: the IDF the SQL computes
    return math.log(1 + (n - df + 0.5) / (df + 0.5))
