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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="tiny model directory")
    ap.add_argument("--mb", type=float, default=20.0, help="size of the huge request's text, MB")
    ap.add_argument("--big", type=int, default=3, help="how many huge requests, one after another")
    ap.add_argument("--smalls", type=int, default=5, help="small requests measured per phase")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra closedloop serve argument")
    args = ap.parse_args()
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
