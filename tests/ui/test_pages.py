"""The viewer over real HTTP (uvicorn on loopback) on a store written through the store's API:
every page kind, filters, token classes and hover data, recomputed advantages, media, hostile
content rendered as text, the CSP and the Host check."""

from __future__ import annotations

import html
import re

import httpx
import pytest
from sample_store import HOSTILE, HUGE_LEN

from closedloop.store import RunStore


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=120) as client:
        yield client


def ids_on(page: str) -> list[str]:
    return re.findall(r'data-run-id="([0-9a-f-]+)"', page)


def test_runs_page_filters_and_facets(http, sample):
    page = http.get("/").text
    top = set(ids_on(page))
    assert {sample.interactive, sample.waiting, sample.tau_eval, sample.kb_eval, sample.train} <= top
    assert sample.rollouts[0] not in top  # children are under their parent unless asked for
    assert sample.rollouts[0] in ids_on(http.get("/", params={"scope": "all"}).text)
    evals = set(ids_on(http.get("/", params={"kind": "eval"}).text))
    assert evals == {sample.tau_eval, sample.kb_eval, sample.demo_eval, sample.demo_eval_b, sample.factguard_eval}
    assert ids_on(http.get("/", params={"status": "waiting"}).text) == [sample.waiting]
    assert set(ids_on(http.get("/", params={"tag": "stage:grpo"}).text)) >= {sample.demo_eval_b}
    assert sample.kb_eval in ids_on(http.get("/", params={"q": "KERNELBENCH"}).text)  # search: tags, any case
    assert ids_on(http.get("/", params={"since": "2999-01-01"}).text) == []
    assert '<option value="eval"' in page and "(4)" in page  # facet with its count
    bad = http.get("/", params={"status": "exploded"})
    assert bad.status_code == 400 and "status must be one of" in bad.text


def test_trace_shows_turns_tools_approvals_and_subruns(http, sample):
    page = http.get(f"/runs/{sample.interactive}").text
    assert page.count('class="step turn"') == 3 and page.count('class="step tool') == 3
    assert "approval rejected" in page and "validation" in page
    assert f'/runs/{sample.interactive}/turns/0' in page
    assert "unavailable: token_ids, logprobs" in page
    assert 'class="waterfall"' in page
    waiting = http.get(f"/runs/{sample.waiting}").text
    assert "waiting for approval" in waiting and "send_email" in waiting
    tau = http.get(f"/runs/{sample.tau_eval}").text
    assert "Sub-runs" in tau and f'/evals/{sample.tau_eval}' in tau


def test_token_view_marks_masked_and_unmasked_tokens(http, sample):
    run = RunStore(sample.path).get_run(sample.interactive, media="refs")
    turn = run.turns[0]
    page = http.get(f"/runs/{sample.interactive}/turns/0").text
    masks = re.findall(r'<span class="tok (m[01])[^"]*" data-mask="([01])" title="([^"]*)"', page)
    assert [int(m) for _, m, _ in masks] == turn.loss_mask  # every token, in order, with its recorded mask
    assert all(cls == f"m{m}" for cls, m, _ in masks)
    titles = [html.unescape(t) for _, _, t in masks]
    first_completion = len(turn.prompt_ids)
    assert f"id {turn.completion_ids[0]}" in titles[first_completion]
    assert f"logprob {turn.logprobs[0]:.4f}" in titles[first_completion] and "logprob" not in titles[0]
    assert "tokenizer from" in page  # decoded with the run's own tokenizer.json
    lp = http.get(f"/runs/{sample.interactive}/turns/0", params={"color": "logprob"}).text
    assert 'class="tok lp' in lp
    remote = http.get(f"/runs/{sample.interactive}/turns/2").text
    assert "What the backend could not give" in remote and "rejected &#39;return_token_ids&#39;" in remote


def test_rollout_token_view_recomputes_the_trainers_advantage(http, sample):
    store = RunStore(sample.path)
    target = next(r for r in sample.rollouts if store.get_run(r).metadata.get("sample") == 0)
    page = http.get(f"/runs/{target}/turns/0", params={"color": "advantage"}).text
    # group of two rewards (1, 0): A = (1 - 0.5) / (std 0.7071 + 1e-4), TRL's formula
    expected = 0.5 / (0.5 ** 0.5 + 1e-4)
    assert f"advantage +{expected:.4f}" in page
    assert 'class="tok avp3' in page and "recomputed from the 4 rollouts of step:5" in page


def test_media_served_by_content_address_with_a_safe_type(http, sample):
    import hashlib

    sha = hashlib.sha256(sample.image).hexdigest()
    r = http.get(f"/media/{sha}")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png" and r.content == sample.image
    assert f'src="/media/{sha}"' in http.get(f"/runs/{sample.interactive}").text
    svg = http.get(f"/media/{sample.svg_sha}")  # recorded as image/svg+xml: a download, never a document
    assert svg.headers["content-type"] == "application/octet-stream" and "attachment" in svg.headers["content-disposition"]
    assert http.get("/media/" + "0" * 64).status_code == 404
    assert http.get("/media/../../etc").status_code == 404


def test_evaluation_pages(http, sample):
    tau = http.get(f"/evals/{sample.tau_eval}").text
    assert re.search(r"pass\^1</td><td class=\"num\">0.75<", tau) and re.search(r"pass\^2</td><td class=\"num\">0.5<", tau)
    assert "DB: final database differs" in tau and "ACTION: expected cancel_order" in tau
    assert f'/runs/{sample.tau_failing_episode}' in tau
    kb = http.get(f"/evals/{sample.kb_eval}").text
    assert "compile_error" in kb and "speedup of correct samples" in kb and "<svg" in kb
    sample_run = next(r.id for r in RunStore(sample.path).list_runs(parent_id=sample.kb_eval, limit=None)
                      if (r.outcome or {}).get("result", {}).get("status") == "compile_error")
    verdict = http.get(f"/runs/{sample_run}").text
    assert "compiler log" in verdict and "expected &#39;;&#39; before" in verdict and "int x = }" in verdict
    fg = http.get(f"/evals/{sample.factguard_eval}").text
    assert "factguard" in fg and re.search(r"metrics.accuracy</td><td class=\"num\">0.5<", fg)
    assert "metrics.accuracy_ci[0]" in fg and "metrics.f1" in fg and "v3" in fg  # every sample listed
    cmp = http.get("/compare", params={"a": sample.demo_eval, "b": sample.demo_eval_b}).text
    assert re.search(r"mean reward.success</td><td class=\"num\">0.25</td><td class=\"num\">0.75</td>"
                     r"<td class=\"num up\">0.5<", cmp)


def test_training_page_curves_smoothing_and_rollouts(http, sample):
    page = http.get(f"/train/{sample.train}").text
    for name in ("loss", "kl", "reward", "rewards/success", "reward components"):
        assert f"<title>{name}</title>" in page
    assert all(r[:12] in page for r in sample.rollouts)
    raw = http.get(f"/train/{sample.train}", params={"smooth": 0}).text
    assert 'class="raw' not in raw and 'class="raw' in page  # smoothing draws the raw values faded under the curve
    assert http.get(f"/train/{sample.train}", params={"smooth": 1.5}).status_code == 400


def test_hostile_content_is_text_and_every_page_has_the_csp(http, sample):
    pages = [f"/runs/{sample.interactive}", f"/runs/{sample.interactive}/turns/1", f"/evals/{sample.tau_eval}",
             "/?scope=all", f"/runs/{sample.tau_failing_episode}", f"/evals/{sample.kb_eval}"]
    for url in pages:
        r = http.get(url)
        assert r.status_code == 200, url
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"
        assert '<script>document.title' not in r.text and 'onerror="document' not in r.text, url
        assert len(re.findall(r"<script\b", r.text)) == 1  # ours, an external file
        assert "style=" not in r.text  # no inline style anywhere (the CSP would refuse it)
    trace = http.get(f"/runs/{sample.interactive}").text
    from markupsafe import escape

    assert str(escape(HOSTILE)) in trace  # all of it, as text
    assert len(trace) < HUGE_LEN // 2 and "more characters" in trace
    tokens = http.get(f"/runs/{sample.interactive}/turns/1").text  # a 300,000-token completion, a page at a time
    assert "tokens 0–4095 of" in tokens and tokens.count('data-mask=') == 4096 and len(tokens) < 2_000_000
    nxt = http.get(f"/runs/{sample.interactive}/turns/1", params={"start": 4096}).text
    assert "tokens 4096–8191 of" in nxt and 'data-mask="1"' in nxt
    whole = http.get(f"/runs/{sample.interactive}/messages/6.json")
    assert whole.headers["content-type"].startswith("text/plain") and whole.text.count("x") >= HUGE_LEN


def test_requests_for_another_host_are_refused(http, served):
    assert http.get("/", headers={"host": "evil.example"}).status_code == 400
    assert http.get("/", headers={"host": f"localhost:{served.port}"}).status_code == 200


def test_unknown_run_is_a_404_page(http):
    r = http.get("/runs/doesnotexist")
    assert r.status_code == 404 and "no run with id" in r.text


def test_front_end_files_ship_in_the_wheel():
    """pyproject.toml's package data must match every template and static file (they are in packages)."""
    import fnmatch
    import pathlib
    import tomllib

    from closedloop.ui.app import static_files

    pyproject = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["*"]
    for path in static_files():
        assert (path.parent / "__init__.py").exists(), f"{path.parent} is not a package: its files would not ship"
        assert path.name == "__init__.py" or any(fnmatch.fnmatch(path.name, g) for g in globs), path


def test_a_live_page_never_carries_a_version_newer_than_its_data(tmp_path):
    """A write landing while a page is read must show up at the next poll: the page's version is
    read before its data (else the page would look current and the write stay hidden)."""
    from ui_support import ServedUI

    store = RunStore(tmp_path / "runs.duckdb")
    rid = store.start_run(kind="train")
    with ServedUI(store=str(tmp_path / "runs.duckdb")) as ui:
        served_store = ui.app.state.store
        real_get_run = served_store.get_run

        def get_run_then_a_write_lands(run_id, **kw):
            run = real_get_run(run_id, **kw)
            store.finish_run(rid, "completed")  # another writer, between the page's reads
            return run

        served_store.get_run = get_run_then_a_write_lands
        page = httpx.get(f"{ui.url}/train/{rid}", timeout=60).text
        served_store.get_run = real_get_run
        shown = re.search(r'data-version="([^"]*)"', page).group(1)
        assert 'data-live="1"' in page  # the page was rendered from the data read before the write
        assert shown != httpx.get(f"{ui.url}/api/version", timeout=60).json()["version"]  # so its next poll refreshes
