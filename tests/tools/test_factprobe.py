"""FactProbe (paper 1): BM25 over a local DuckDB corpus, web backends through their real HTTP APIs
(a local server that speaks them), social media excluded, one report format."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from closedloop.tools.factprobe import (BraveBackend, LocalCorpus, SearchError, SearxNGBackend, SerperBackend,
                                        TavilyBackend, backend_from_env, is_social_media, make_factprobe_tool, report,
                                        tokenize)

DOCS = [
    {"id": "a", "title": "Flood in Valencia", "text": "Heavy rain caused a flood in Valencia in October.",
     "url": "https://news.example/a"},
    {"id": "b", "title": "Shark video is fake", "text": "The video of a shark on the highway was edited; no shark "
     "swam on the highway during the flood.", "url": "https://factcheck.example/b"},
    {"id": "c", "title": "shark!!", "text": "shark shark highway flood", "url": "https://www.tiktok.com/@u/1"},
    {"id": "d", "title": "Café reopens", "text": "The café on the main street reopened after the flood.",
     "url": "https://news.example/d"},
    {"id": "e", "title": "Weather", "text": "Sunny tomorrow.", "url": "https://weather.example/e"},
]


def bm25_reference(query: str, docs, k1=1.2, b=0.75) -> dict[int, float]:
    """Okapi BM25 with Lucene's IDF, written out plainly."""
    toks = [tokenize(f"{d['title']} {d['text']}") for d in docs]
    n, avgdl = len(docs), sum(map(len, toks)) / len(docs)
    out = {}
    for i, t in enumerate(toks):
        tf = Counter(t)
        s = 0.0
        for term in tokenize(query):
            if tf[term]:
                df = sum(term in x for x in toks)
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                s += idf * tf[term] * (k1 + 1) / (tf[term] + k1 * (1 - b + b * len(t) / avgdl))
        if s:
            out[i] = s
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return LocalCorpus.build(tmp_path_factory.mktemp("c") / "corpus.duckdb", DOCS)


@pytest.mark.parametrize("query", ["shark highway", "flood", "cafe reopened flood", "sunny shark video valencia"])
def test_bm25_in_sql_equals_the_formula(corpus, query):
    ours = corpus.scores(query)
    ref = bm25_reference(query, DOCS)
    assert ours.keys() == ref.keys()
    for d in ref:
        assert ours[d] == pytest.approx(ref[d], rel=1e-9)


def test_search_ranks_drops_social_media_and_matches_accents(corpus):
    hits = corpus.search("shark highway", k=3)
    assert [h.link for h in hits][0] == "https://factcheck.example/b"
    assert not any("tiktok" in h.link for h in hits)  # doc c scores high but is a social-media post
    assert "tiktok" in str(corpus.raw_search("shark highway", 5))  # it was there before the filter
    assert corpus.search("cafe")[0].link == "https://news.example/d"  # "café" indexed accent-free
    assert corpus.search("zeppelin") == []
    with pytest.raises(ValueError, match="empty"):
        corpus.search("   ")


def test_social_media_hosts():
    assert is_social_media("https://m.youtube.com/watch?v=1") and is_social_media("https://x.com/a")
    assert not is_social_media("https://xx.com/a") and not is_social_media("https://news.example/youtube.com")


def test_tool_report(corpus):
    tool = make_factprobe_tool(corpus, k=2)
    out = asyncio.run(tool.run({"query": "flood"}))
    assert out.ok and out.content.startswith('FactProbe evidence for "flood" (2 results):')
    assert "source: https://" in out.content and "tiktok" not in out.content
    assert report("q", []) == 'FactProbe found no evidence for "q".'


# ------------------------------------------------------------------ web backends against a local server


@pytest.fixture(scope="module")
def fake_web():
    """One local HTTP server speaking Serper's, Tavily's, Brave's and SearxNG's search APIs, checking
    each one's authentication the way the service does, and recording what it received."""
    from closedloop.server.local import serve_app

    seen: list[dict] = []
    social = {"title": "post", "url": "https://www.facebook.com/p/1", "link": "https://www.facebook.com/p/1"}
    app = FastAPI()

    @app.post("/search")
    async def post_search(request: Request):
        body = await request.json()
        seen.append({"path": "POST /search", "body": body, "headers": dict(request.headers)})
        if "q" in body:  # Serper
            if request.headers.get("x-api-key") != "serper-key":
                return JSONResponse({"message": "Unauthorized."}, status_code=403)
            return {"organic": [{"title": "Serper hit", "link": "https://a.example/1", "snippet": "s1"},
                                {**social, "snippet": "x"}][: body["num"]]}
        if request.headers.get("authorization") != "Bearer tavily-key":  # Tavily
            return JSONResponse({"detail": {"error": "Unauthorized"}}, status_code=401)
        return {"results": [{"title": "Tavily hit", "url": "https://b.example/1", "content": "c1", "score": 0.9},
                            {**social, "content": "x"}]}

    @app.get("/res/v1/web/search")
    async def brave(request: Request):
        seen.append({"path": "GET brave", "params": dict(request.query_params)})
        if request.headers.get("x-subscription-token") != "brave-key":
            return JSONResponse({"error": "bad token"}, status_code=401)
        return {"web": {"results": [{"title": "Brave hit", "url": "https://c.example/1", "description": "d1"}]}}

    @app.get("/search")
    async def searx(request: Request):
        seen.append({"path": "GET searx", "params": dict(request.query_params)})
        if request.query_params.get("format") != "json":
            return JSONResponse({"error": "format"}, status_code=403)
        return {"results": [{"title": "Searx hit", "url": "https://d.example/1", "content": "e1"},
                            {**social, "content": "x"}]}

    with serve_app(app) as base:
        yield base.removesuffix("/v1"), seen


def test_web_backends_speak_their_apis_and_filter_social_media(fake_web):
    base, seen = fake_web
    cases = [(SerperBackend("serper-key", base), "Serper hit", {"q": "flood", "num": 6}),
             (TavilyBackend("tavily-key", base), "Tavily hit", {"query": "flood", "max_results": 6}),
             (BraveBackend("brave-key", base), "Brave hit", {"q": "flood", "count": "6"}),
             (SearxNGBackend(base), "Searx hit", {"q": "flood", "format": "json"})]
    for backend, title, sent in cases:
        hits = backend.search("flood", k=1)
        assert [h.title for h in hits] == [title]
        assert seen[-1].get("body", seen[-1].get("params")) == sent  # k + 5 asked, to survive the filter
        assert not any(is_social_media(h.link) for h in backend.search("flood", k=5))


def test_web_errors_are_clear(fake_web):
    base, _ = fake_web
    with pytest.raises(SearchError, match="serper: HTTP 403"):
        SerperBackend("wrong", base).search("x")
    with pytest.raises(SearchError, match="tavily: HTTP 401"):
        TavilyBackend("wrong", base).search("x")
    with pytest.raises(SearchError, match="request to 127.0.0.1:9 failed"):
        SearxNGBackend("http://127.0.0.1:9").search("x")


def test_backend_from_env(corpus, fake_web):
    base, _ = fake_web
    assert isinstance(backend_from_env(env={"CLOSEDLOOP_SEARCH_CORPUS": str(corpus.path)}), LocalCorpus)
    b = backend_from_env(env={"SERPER_API_KEY": "serper-key", "SERPER_BASE_URL": base})
    assert isinstance(b, SerperBackend) and b.search("q")[0].title == "Serper hit"
    assert isinstance(backend_from_env(env={"CLOSEDLOOP_SEARCH": "searxng", "SEARXNG_URL": base}), SearxNGBackend)
    with pytest.raises(ValueError, match="no search backend configured"):
        backend_from_env(env={})
    with pytest.raises(ValueError, match="needs BRAVE_API_KEY"):
        backend_from_env(env={"CLOSEDLOOP_SEARCH": "brave"})
    with pytest.raises(ValueError, match="expected one of"):
        backend_from_env(env={"CLOSEDLOOP_SEARCH": "bing"})
