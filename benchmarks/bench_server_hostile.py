"""How much one huge request hurts everyone else on ``closedloop serve`` (issue 9, finding 10).

Starts ``closedloop serve`` on the tiny model (a subprocess, as a user runs it), then:

1. blocking: the latency of small requests sent while a huge request (``--mb`` MB of user text) is
   being parsed and tokenised, as a ratio to the same small requests on an idle server;
2. memory: the server's RSS at start, after each huge request, and the growth that stays.

Run it against another tree (the code before a change) with ``PYTHONPATH=/that/tree``; pass
``--serve-arg=--max-request-bytes=...`` when the server under test has a request cap below the
huge request (or leave the default cap and see the huge request refused with 413).

    python benchmarks/bench_server_hostile.py --model /path/to/tiny --mb 20 --big 3 \\
        --serve-arg=--max-request-bytes=67108864
    python benchmarks/bench_server_hostile.py --model /path/to/tiny --disconnect 4000   # finding 11
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
import psutil
from rich.console import Console

from closedloop.server.local import serve_subprocess

console = Console()


async def _small(http: httpx.AsyncClient, url: str, i: int) -> float:
    t0 = time.perf_counter()
    r = await http.post(f"{url}/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": f"Hello {i}"}], "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


async def _measure(url: str, mb: float, big: int, smalls: int) -> dict:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    proc = next(p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and str(port) in p.info["cmdline"])
    rss = lambda: proc.memory_info().rss / 2 ** 20  # noqa: E731
    out: dict = {"rss_start_mb": rss()}
    async with httpx.AsyncClient(timeout=600) as http:
        idle = [await _small(http, url, i) for i in range(smalls)]
        out["idle_median_s"] = statistics.median(idle)
        text = ("lorem ipsum dolor sit amet " * int(mb * 2 ** 20 / 27 + 1))[:int(mb * 2 ** 20)]
        busy, statuses, rss_after = [], [], []
        for k in range(big):
            huge = asyncio.ensure_future(http.post(f"{url}/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4}))
            await asyncio.sleep(0.5)  # the huge body is being parsed / tokenised now
            while not huge.done() and len(busy) < smalls * (k + 1):
                busy.append(await _small(http, url, k * 100 + len(busy)))
            r = await huge
            statuses.append(r.status_code)
            await asyncio.sleep(1.0)
            rss_after.append(rss())
        out.update(busy_median_s=statistics.median(busy) if busy else float("nan"), busy_n=len(busy),
                   huge_status=statuses, rss_after_each_mb=[round(x) for x in rss_after])
    out["rss_growth_kept_mb"] = out["rss_after_each_mb"][-1] - out["rss_start_mb"]
    return out


def disconnect_cost(model: str, max_tokens: int) -> dict:
    """Finding 11: a streaming client asks for ``max_tokens`` and walks away after the first text.
    The model's end-of-sequence ids are removed (so only max_tokens or a cancellation stops it);
    reports the CPU seconds the server (a thread of this process) spends after the disconnect and how long a small request
    sent right after it takes, next to the same small request on an idle server."""
    import torch

    from closedloop.models.hf import HFClient
    from closedloop.server import create_app
    from closedloop.server.local import serve_app

    torch.set_num_threads(1)
    client = HFClient.from_pretrained(model)
    client._eos_ids = set()
    me = psutil.Process()
    kwargs = {"max_tokens_cap": max_tokens} if "max_tokens_cap" in create_app.__kwdefaults__ else {}
    small = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
    with serve_app(create_app(client, "tiny", default_max_tokens=8, **kwargs)) as url:
        t0 = time.perf_counter()
        httpx.post(f"{url}/chat/completions", json=small, timeout=600).raise_for_status()
        idle = time.perf_counter() - t0
        with httpx.stream("POST", f"{url}/chat/completions", timeout=600, json={
                "model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "stream": True,
                "max_tokens": max_tokens, "temperature": 0}) as r:  # greedy: plain text first, streamed at once
            for line in r.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    break
        cpu0 = sum(me.cpu_times()[:2])
        t0 = time.perf_counter()
        httpx.post(f"{url}/chat/completions", json=small, timeout=600).raise_for_status()
        after = time.perf_counter() - t0
        time.sleep(2.0)
        cpu = sum(me.cpu_times()[:2]) - cpu0
    return {"idle_s": idle, "after_disconnect_s": after, "cpu_s_after_disconnect": cpu,
            "cancelled_rows": getattr(client, "cancelled_rows", None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="tiny model directory")
    ap.add_argument("--mb", type=float, default=20.0, help="size of the huge request's text, MB")
    ap.add_argument("--big", type=int, default=3, help="how many huge requests, one after another")
    ap.add_argument("--smalls", type=int, default=5, help="small requests measured per phase")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra closedloop serve argument")
    ap.add_argument("--disconnect", type=int, default=0, metavar="MAX_TOKENS",
                    help="instead: the cost of a stream abandoned after its first text (finding 11)")
    args = ap.parse_args()
    if args.disconnect:
        res = disconnect_cost(args.model, args.disconnect)
        console.print(f"small request: idle {res['idle_s'] * 1000:.0f} ms, right after the disconnect "
                      f"{res['after_disconnect_s'] * 1000:.0f} ms; server CPU in the 2 s after: "
                      f"{res['cpu_s_after_disconnect']:.1f} s; rows cancelled: {res['cancelled_rows']}")
        return
    with console.status("starting closedloop serve ..."):
        ctx = serve_subprocess(f"hf:{args.model}", "--torch-threads", "1", *args.serve_arg, served_name="tiny")
        url = ctx.__enter__()
    try:
        with console.status(f"{args.big} requests of {args.mb:g} MB, small requests beside them ..."):
            res = asyncio.run(_measure(url, args.mb, args.big, args.smalls))
    finally:
        ctx.__exit__(None, None, None)
    ratio = res["busy_median_s"] / res["idle_median_s"]
    console.print(f"huge request status: {res['huge_status']}")
    console.print(f"small request median: idle {res['idle_median_s'] * 1000:.0f} ms, beside a huge one "
                  f"{res['busy_median_s'] * 1000:.0f} ms (x{ratio:.1f}, {res['busy_n']} measured)")
    console.print(f"server RSS: start {res['rss_start_mb']:.0f} MB, after each huge request "
                  f"{res['rss_after_each_mb']} MB, kept {res['rss_growth_kept_mb']:+.0f} MB")


if __name__ == "__main__":
    main()
