"""The viewer's web app: FastAPI routes rendering Jinja2 templates (autoescaped), a strict CSP.

Pages: ``/`` runs · ``/runs/{id}`` trace · ``/runs/{id}/turns/{k}`` token view · ``/evals/{id}``
evaluation (``/compare?a=&b=`` two side by side) · ``/train/{id}`` training. ``/media/{sha256}``
serves stored images/audio, ``/api/version`` the change fingerprint the live pages poll.

Safety: every stored string is rendered as text (Jinja2 autoescaping; no ``|safe`` on user
content; charts escape their labels), the Content-Security-Policy allows scripts, styles, images
and fetches from this origin only (no inline script or style at all), media are served with
their recorded type only when it is an image or audio type that cannot carry script, and the
Host header must name this machine (a page elsewhere cannot reach the viewer by DNS rebinding)
unless the viewer was started for other hosts. Endpoints are plain ``def``: FastAPI runs them on
its thread pool, so a read that waits for a writer's lock never stalls the event loop.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import duckdb
import jinja2
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.middleware.trustedhost import TrustedHostMiddleware

from closedloop.messages import content_text
from closedloop.store import RunNotFoundError, RunStore, StoreBusyError
from closedloop.store.media import REF_PREFIX
from closedloop.ui import charts, queries
from closedloop.ui.evals import eval_view
from closedloop.ui.tokens import TOKEN_PAGE, advantage_class, find_tokenizer, logprob_class, rollout_advantages, token_table
from closedloop.ui.trace import build_trace, pending_approvals, pretty_json

__all__ = ["UISettings", "create_app", "LOOPBACK_HOSTS", "CSP"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; media-src 'self'; "
       "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
# Media types served as themselves; anything else (SVG can hold script, HTML obviously) is a download.
SAFE_MEDIA = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp", "audio/wav", "audio/x-wav",
                        "audio/wave", "audio/mpeg", "audio/mp3", "audio/ogg", "audio/flac", "audio/webm"})
TEXT_LIMIT = 20_000  # characters of one text block shown on a page; the rest is one click away (raw)


class UISettings(BaseModel):
    store: str | None = Field(default=None, description="run store file (default: $CLOSEDLOOP_STORE, ~/.closedloop/runs.duckdb)")
    tokenizer: str | None = Field(default=None, description="tokenizer.json (or a model directory) for token text")
    poll_ms: int = Field(default=2000, ge=50, le=600_000, description="how often live pages check the store for changes")
    allowed_hosts: list[str] = Field(default_factory=lambda: list(LOOPBACK_HOSTS),
                                     description="Host header values served (['*']: any)")


def _template_env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("closedloop.ui", "templates"), autoescape=True, trim_blocks=True,
                             lstrip_blocks=True)
    env.filters.update(time=_fmt_time, dur=_fmt_dur, cost=_fmt_cost, num=_fmt_num, short=lambda s: (s or "")[:12],
                       qs=lambda d: urlencode(d), clip=_clip, pjson=pretty_json, lpclass=logprob_class,
                       avclass=advantage_class, tojson_text=lambda v: json.dumps(v, indent=2, default=str,
                                                                                 ensure_ascii=False))
    env.globals.update(parts=_parts, content_text=content_text)
    return env


def _fmt_time(ts: datetime | None) -> str:
    return ts.strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _fmt_dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _fmt_cost(cost: float | None) -> str:
    return "-" if cost is None else f"${cost:.4f}"


def _fmt_num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


@dataclass
class Clipped:
    text: str
    more: int  # characters not shown


def _clip(text: Any, limit: int = TEXT_LIMIT) -> Clipped:
    s = "" if text is None else str(text)
    return Clipped(s[:limit], max(len(s) - limit, 0))


@dataclass
class Part:
    kind: str  # "text" | "image" | "audio" | "other"
    text: str = ""
    media: str | None = None  # sha256 of stored media
    note: str = ""


def _parts(content: Any) -> list[Part]:
    """A message's content as parts to render; media references become ``/media`` links, inline
    payloads and remote URLs are named, never fetched."""
    if content is None:
        return []
    if isinstance(content, str):
        return [Part("text", content)]
    out = []
    for p in content:
        kind = getattr(p, "type", None)
        if kind == "text":
            out.append(Part("text", p.text))
        elif kind == "image_url":
            url = p.image_url.url
            if url.startswith(REF_PREFIX):
                out.append(Part("image", media=url[len(REF_PREFIX):len(REF_PREFIX) + 64]))
            else:
                out.append(Part("other", note=f"image at {url[:120]}" if not url.startswith("data:") else
                                f"inline image ({len(url)} characters of data URL), not stored as media"))
        elif kind == "input_audio":
            data = p.input_audio.data
            if data.startswith(REF_PREFIX):
                out.append(Part("audio", media=data[len(REF_PREFIX):len(REF_PREFIX) + 64]))
            else:
                out.append(Part("other", note=f"inline audio ({len(data)} characters)"))
        else:
            out.append(Part("other", note=f"{kind} part"))
    return out


def create_app(settings: UISettings | None = None) -> FastAPI:
    settings = settings or UISettings()
    store = RunStore(settings.store)
    env = _template_env()
    app = FastAPI(title="closedloop ui", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.allowed_hosts)
    static = resources.files("closedloop.ui") / "static"

    app.middleware("http")(_security_headers)

    def page(name: str, status_code: int = 200, *, live: str | None = None, **ctx: Any) -> HTMLResponse:
        """``live``: the store's fingerprint read *before* the page's data (see :func:`version`), or
        None for a page that does not refresh itself."""
        version = live or ""
        html = env.get_template(name).render(store_path=str(store.path), poll_ms=settings.poll_ms,
                                             live=live is not None, version=version, **ctx)
        return HTMLResponse(html, status_code=status_code)

    def version() -> str:
        """The fingerprint a live page carries, read before its data: a write landing in between
        makes the page look one change older than it is (one extra refresh), never newer (which
        would hide that write until the next one)."""
        return queries.fingerprint(store)

    _error_pages(app, page)

    @app.get("/", response_class=HTMLResponse)
    def runs(request: Request) -> HTMLResponse:
        f = queries.RunFilter.model_validate(dict(request.query_params))
        result = queries.runs_page(store, f)  # its version is read in the same transaction as its rows
        return page("runs.jinja", live=result.version, title="runs", f=f, result=result, filter_query=f.query())

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    def trace(run_id: str) -> HTMLResponse:
        kids = queries.children(store, run_id)  # first: the version it carries precedes the run's data
        run = store.get_run(run_id, media="refs")
        t = build_trace(run)
        return page("trace.jinja", live=kids.version if run.status == "running" else None,
                    title=f"run {run.id[:12]}", run=run, trace=t,
                    waterfall=charts.waterfall(t.waterfall), kids=kids.rows, n_kids=kids.total,
                    pending=pending_approvals(run) if run.status == "waiting" else [],
                    outcome_view=_outcome_view(run.outcome), is_train=run.kind == "train",
                    is_eval=run.kind == "eval" or kids.total > 0 and run.kind != "train")

    @app.get("/runs/{run_id}/turns/{index}", response_class=HTMLResponse)
    def turn(run_id: str, index: int, color: str = "mask", start: int = 0) -> HTMLResponse:
        if color not in ("mask", "logprob", "advantage"):
            raise HTTPException(400, "color must be mask, logprob or advantage")
        run = store.get_run(run_id, media="refs")
        if not 0 <= index < len(run.turns):
            raise RunNotFoundError(f"run {run.id} has no turn {index} (it has {len(run.turns)})")
        t = run.turns[index]
        path, note = find_tokenizer([t.model, run.model_spec, _parent_spec(store, run.parent_id)], settings.tokenizer)
        turn_adv, adv_note = _turn_advantage(store, run, index)
        table = token_table(t, path, note, turn_adv, start=start)
        tr = build_trace(run)
        seen = tr.turn_messages.get(index, len(run.messages))
        return page("turn.jinja", title=f"turn {index} of {run.id[:12]}", run=run, turn=t, index=index, table=table,
                    color=color, adv_note=adv_note, has_adv=turn_adv is not None, prompt=run.messages[:seen],
                    page_size=TOKEN_PAGE)

    @app.get("/runs/{run_id}/messages/{index}.json")
    def raw_message(run_id: str, index: int) -> Response:
        """One message as stored (media as references), whole: what a clipped text block links to."""
        run = store.get_run(run_id, media="refs")
        if not 0 <= index < len(run.messages):
            raise RunNotFoundError(f"run {run.id} has no message {index}")
        body = run.messages[index].model_dump_json(indent=2)
        return Response(body, media_type="text/plain; charset=utf-8",
                        headers={"Content-Security-Policy": "sandbox; default-src 'none'"})

    @app.get("/evals/{run_id}", response_class=HTMLResponse)
    def evaluation(run_id: str) -> HTMLResponse:
        v = version()
        view = eval_view(store, run_id)
        return page("eval.jinja", live=v if view.run.status == "running" else None,
                    title=f"evaluation {view.run.id[:12]}", v=view)

    @app.get("/compare", response_class=HTMLResponse)
    def compare(a: str, b: str) -> HTMLResponse:
        va, vb = eval_view(store, a), eval_view(store, b)
        names = sorted(set(va.metrics) | set(vb.metrics))
        items = sorted(set(va.items) | set(vb.items))
        return page("compare.jinja", title="compare evaluations", a=va, b=vb, names=names, items=items)

    @app.get("/train/{run_id}", response_class=HTMLResponse)
    def training(run_id: str, smooth: float = 0.6, step: int | None = None) -> HTMLResponse:
        if not 0 <= smooth < 1:
            raise HTTPException(400, "smooth must be in [0, 1)")
        return _training_page(store, page, version(), run_id, smooth, step)

    @app.get("/media/{sha256}")
    def media(sha256: str) -> Response:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise HTTPException(404, "not a media address")
        found = queries.media(store, sha256)
        if found is None:
            raise HTTPException(404, "no such media in this store")
        mime, data = found
        headers = {"Content-Security-Policy": "sandbox; default-src 'none'", "Cache-Control": "max-age=86400"}
        if mime not in SAFE_MEDIA:
            headers["Content-Disposition"] = f'attachment; filename="{sha256[:16]}"'
            mime = "application/octet-stream"
        return Response(data, media_type=mime, headers=headers)

    @app.get("/api/version")
    def api_version() -> JSONResponse:
        return JSONResponse({"version": queries.fingerprint(store)})

    @app.get("/static/{name}")
    def asset(name: str) -> Response:
        types = {"app.css": "text/css; charset=utf-8", "app.js": "text/javascript; charset=utf-8"}
        if name not in types:
            raise HTTPException(404)
        return Response((static / name).read_bytes(), media_type=types[name], headers={"Cache-Control": "max-age=300"})

    app.state.store = store
    app.state.settings = settings
    return app


async def _security_headers(request: Request, call_next: Any) -> Response:
    """Every response: what it cost the server, a strict content policy, no sniffing, framing or caching."""
    started = time.perf_counter()
    response = await call_next(request)
    # what the page cost the server (browsers show it; benchmarks/bench_ui.py reads it)
    response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers.setdefault("Cache-Control", "no-store")
    return response


def _error_pages(app: FastAPI, page: Any) -> None:
    """The store's and the request's errors as pages (``page`` renders one)."""

    @app.exception_handler(RunNotFoundError)
    def not_found(request: Request, exc: RunNotFoundError) -> HTMLResponse:
        return page("error.jinja", 404, title="not found", message=str(exc))

    @app.exception_handler(StoreBusyError)
    def busy(request: Request, exc: StoreBusyError) -> HTMLResponse:
        return page("error.jinja", 503, title="store busy", message=f"{exc} (this page retries on reload)")

    @app.exception_handler(duckdb.Error)
    def unreadable(request: Request, exc: duckdb.Error) -> HTMLResponse:
        # e.g. a read that met a writer's half-finished checkpoint: nothing was changed, try again
        return page("error.jinja", 503, title="store not readable right now",
                    message=f"{type(exc).__name__}: {exc} (nothing was changed; this page retries on reload)")

    @app.exception_handler(ValidationError)
    def bad_query(request: Request, exc: ValidationError) -> HTMLResponse:
        msg = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return page("error.jinja", 400, title="bad request", message=msg)


def _metric_charts(rows: list[dict[str, Any]], smooth: float) -> tuple[dict[str, tuple[list[float], list[float]]],
                                                                       list[Any]]:
    """A training run's metric series by name, and their charts (reward components together first)."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        for name, value in row.items():
            if name != "step":
                xs, ys = series.setdefault(name, ([], []))
                xs.append(float(row["step"]))
                ys.append(float(value))
    reward_names = [n for n in series if n.startswith("rewards/") or n == "reward"]
    chart_list = []
    if reward_names:
        chart_list.append(charts.line_chart("reward components", [(n, *series[n]) for n in reward_names]))
    for name in sorted(series):
        xs, ys = series[name]
        chart_list.append(charts.line_chart(name, [(f"{name} (smoothed {smooth:g})", xs, charts.ema(ys, smooth))],
                                            faded=[(name, xs, ys)] if smooth > 0 else []))
    return series, chart_list


def _turn_advantage(store: RunStore, run: Any, index: int) -> tuple[float | None, str]:
    """Turn ``index``'s GRPO advantage, or None and the note saying why it has none."""
    advs, adv_note = (None, "only GRPO rollouts have advantages")
    if run.kind == "rollout":
        advs, adv_note = rollout_advantages(store, run)
    turn_adv = advs[index] if advs is not None and index < len(advs) else None
    if advs is not None and not run.turns[index].trainable:
        turn_adv, adv_note = None, "a helper call (trainable=False): not trained, no advantage"
    return turn_adv, adv_note


def _training_page(store: RunStore, page: Any, v: str, run_id: str, smooth: float, step: int | None) -> HTMLResponse:
    """A training run: its metric charts and the rollouts of one step (the last by default)."""
    run = store.get_run(run_id, media="refs")
    rows = store.metrics(run.id)
    series, chart_list = _metric_charts(rows, smooth)
    steps = queries.child_steps(store, run.id)
    shown = step if step is not None else (steps[-1] if steps else None)
    rollouts = store.list_runs(limit=None, parent_id=run.id, tag=f"step:{shown}") if shown is not None else []
    last = rows[-1]["step"] if rows else None
    return page("train.jinja", live=v if run.status == "running" else None, title=f"training {run.id[:12]}", run=run,
                charts=chart_list, steps=steps, shown=shown, rollouts=rollouts, smooth=smooth,
                metric_names=sorted(series), last_step=last)


def _parent_spec(store: RunStore, parent_id: str | None) -> str | None:
    if parent_id is None:
        return None
    try:
        return store.get_run(parent_id, media="refs").model_spec
    except RunNotFoundError:
        return None


def _outcome_view(outcome: dict[str, Any] | None) -> dict[str, Any]:
    """The parts of an outcome the trace page shows apart: rewards, a KernelBench verdict, a τ grade."""
    if not outcome:
        return {}
    view: dict[str, Any] = {"rewards": outcome.get("rewards") or {}}
    result = outcome.get("result")
    if isinstance(result, dict) and "status" in result:
        view["kernel"] = {k: result.get(k) for k in ("status", "message", "speedup", "max_diff", "compiler_log",
                                                      "traceback_tail", "not_timed_reason")}
        view["code"] = outcome.get("code")
    sim = outcome.get("simulation")
    if isinstance(sim, dict) and "termination_reason" in sim:
        from closedloop.evals.tau.simulation import RewardInfo
        from closedloop.ui.evals import failing_checks

        info = sim.get("reward_info")
        view["tau"] = {"reward": outcome.get("reward"), "termination": sim.get("termination_reason"),
                       "failing": failing_checks(RewardInfo.model_validate(info) if info else None)}
    rest = {k: v for k, v in outcome.items() if k not in ("rewards", "result", "code", "simulation")}
    view["rest"] = rest
    return view


def static_files() -> list[Path]:
    """The front end's files (tests check they ship in the wheel)."""
    root = Path(str(resources.files("closedloop.ui")))
    return sorted(p for sub in ("static", "templates") for p in (root / sub).iterdir() if p.is_file())
