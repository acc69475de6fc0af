"""Throughput of ``closedloop serve`` under 1, 8 and 32 concurrent clients.

The server's claim is that it does not serialise requests: concurrent requests reach the HF
client's micro-batching queue together and are decoded as one batch. If that holds, requests/s
grows with the number of clients; if the server (or the client) serialised them, the ratio would
stay near 1. The server is the real CLI (``python -m closedloop serve``) in a subprocess, driven
over HTTP by our ``openai:`` backend, so the figure includes the whole stack.

    python benchmarks/bench_serve.py                      # builds the tiny model into a temp dir
    python benchmarks/bench_serve.py --model /path/to/ckpt --concurrency 1 8 32 --requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from closedloop.messages import UserMessage
from closedloop.models import SamplingParams
from closedloop.models.openai_client import OpenAIClient

PROMPTS = ["What is 3 plus 4?", "What is the weather in Paris?", "Hello!", "Multiply 6 by 7.",
           "Tell me a joke.", "How is the weather in Oslo?", "What is 12 + 30?", "Who are you?"]


@dataclass
class Level:
    concurrency: int
    requests: int
    wall_s: float
    completion_tokens: int
    latencies: list[float]
    mean_batch: float | None = None

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s

    @property
    def tps(self) -> float:
        return self.completion_tokens / self.wall_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, max_tokens: int, max_batch_size: int,
                 torch_threads: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "closedloop", "serve", "--model", f"hf:{model}", "--port", str(port),
           "--served-name", "tiny", "--max-tokens", str(max_tokens), "--max-batch-size", str(max_batch_size)]
    env = dict(os.environ)
    if torch_threads:
        cmd += ["--torch-threads", str(torch_threads)]
        env["OMP_NUM_THREADS"] = str(torch_threads)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up within 180 s")


async def run_level(url: str, concurrency: int, n_requests: int, max_tokens: int, seed: int) -> Level:
    client = OpenAIClient("tiny", base_url=url, concurrency=concurrency, timeout_s=600)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=seed)
    next_i = 0
    latencies: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal next_i, tokens
        while next_i < n_requests:
            i = next_i
            next_i += 1
            turn = await client.generate([UserMessage(content=PROMPTS[i % len(PROMPTS)])], params=params)
            latencies.append(turn.latency_s or 0.0)
            tokens += turn.usage.completion_tokens

    before = batch_stats(url)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    after = batch_stats(url)
    await client.aclose()
    mean_batch = None
    if before and after and after["batches"] > before["batches"]:
        mean_batch = (after["requests"] - before["requests"]) / (after["batches"] - before["batches"])
    return Level(concurrency, n_requests, wall, tokens, latencies, mean_batch)


def batch_stats(url: str) -> dict | None:
    """The server's micro-batcher record (requests and device batches so far), if it keeps one."""
    return httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json().get("batches")


def report(levels: list[Level], console: Console, title: str) -> None:
    base = levels[0].rps
    table = Table(title=title)
    for col in ("clients", "requests", "wall s", "req/s", "tok/s", "p50 lat s", "p95 lat s",
                "mean batch", f"req/s vs {levels[0].concurrency} client(s)"):
        table.add_column(col, justify="right")
    for lv in levels:
        lat = sorted(lv.latencies)
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
        table.add_row(str(lv.concurrency), str(lv.requests), f"{lv.wall_s:.2f}", f"{lv.rps:.2f}", f"{lv.tps:.1f}",
                      f"{statistics.median(lat):.3f}", f"{p95:.3f}",
                      "-" if lv.mean_batch is None else f"{lv.mean_batch:.1f}", f"{lv.rps / base:.2f}x")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="HF checkpoint dir (default: build the tiny model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch-size", type=int, default=32, help="the server's micro-batch limit")
    # On a shared, oversubscribed CPU, OpenMP's spinning threads made a 2-thread decode 10-100x
    # slower than a 1-thread one (measured); 0 leaves torch's default.
    ap.add_argument("--torch-threads", type=int, default=1, help="server's torch threads (0: torch default)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    console = Console(width=max(Console().width, 110))

    tmp = None
    model = args.model
    if model is None:
        from closedloop.models.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="bench-serve-")
        console.print("building the tiny model ...")
        model = build_tiny_model(Path(tmp.name) / "tiny", seed=args.seed)
    port = free_port()
    proc = start_server(model, port, args.max_tokens, args.max_batch_size, args.torch_threads or None)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        asyncio.run(run_level(url, 1, 2, args.max_tokens, args.seed))  # warm-up: first-call costs
        levels = [asyncio.run(run_level(url, c, args.requests, args.max_tokens, args.seed))
                  for c in args.concurrency]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        if tmp is not None:
            tmp.cleanup()
    report(levels, console, f"closedloop serve, hf:{model.name}, max_tokens={args.max_tokens}, temperature=0, "
                            f"max batch {args.max_batch_size}, torch threads {args.torch_threads or 'default'}, "
                            f"{os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps([{**asdict(lv), "rps": lv.rps, "tps": lv.tps} for lv in levels], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
