"""Throughput of ``closedloop serve`` against ``transformers serve --continuous-batching``
under 1, 8 and 32 concurrent clients, on the same model, prompts and client, in one run.

Both servers are real CLIs in subprocesses (``python -m closedloop serve`` and transformers'
own ``serve``, each with one torch thread), driven over HTTP by our ``openai:`` backend, so the
figures include the whole stack. Requests use greedy decoding and the same ``max_tokens``; the
ratio column is ours over the peer's requests/s at the same concurrency. ``hf:`` decodes with
continuous batching: a request that arrives while others decode joins them at the next step,
and "mean rows" is how many rows its decode steps carried on average.

    python benchmarks/bench_serve.py                      # builds the tiny model into a temp dir
    python benchmarks/bench_serve.py --model /path/to/ckpt --concurrency 1 8 32 --requests 160
    python benchmarks/bench_serve.py --peer none          # ours only
    python benchmarks/bench_serve.py --in-process         # also hf: without HTTP: the decoder's ceiling

``--in-process`` adds a column: the same prompts and concurrencies through ``HFClient`` in this
process (no HTTP, no server, no load-generator process), i.e. what the decode worker alone
sustains; the gap to the server's figure is the HTTP layer sharing the server's GIL and CPU.
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
from closedloop.models import ModelError, SamplingParams
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
    mean_rows: float | None = None

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
    return wait_up(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env), port)


def start_peer(model: Path, port: int, torch_threads: int | None) -> subprocess.Popen:
    """``transformers serve MODEL --continuous-batching`` (paged attention, its own scheduler)."""
    cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--continuous-batching"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if torch_threads:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    return wait_up(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env), port)


def wait_up(proc: subprocess.Popen, port: int) -> subprocess.Popen:
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


async def answerable(url: str, model: str, prompts: list[str], max_tokens: int, seed: int) -> list[str]:
    """The prompts a server answers at all. ``transformers serve`` answers 500 when the model's
    reply holds a tool call it cannot parse (its response parser raises on the tiny model's
    unfinished JSON), so such prompts are left out for both servers, and the run says so."""
    client = OpenAIClient(model, base_url=url, max_retries=0, timeout_s=120)
    ok = []
    for p in prompts:
        try:
            await client.generate([UserMessage(content=p)], params=SamplingParams(temperature=0.0,
                                                                                  max_tokens=max_tokens, seed=seed))
            ok.append(p)
        except ModelError:
            pass
    await client.aclose()
    return ok


async def run_level_http(url: str, concurrency: int, n_requests: int, max_tokens: int, seed: int,
                         model: str = "tiny", prompts: list[str] = PROMPTS) -> Level:
    """The plain client: one ``httpx.AsyncClient`` posting minimal chat-completion bodies (no
    logprobs, no token ids), so the client process costs little and both servers get identical
    requests. What a load generator does; the ``closedloop`` client below is the full stack."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    next_i = 0
    latencies: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def worker() -> None:
            nonlocal next_i, tokens
            while next_i < n_requests:
                i = next_i
                next_i += 1
                body = {"model": model, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                        "max_tokens": max_tokens, "temperature": 0.0, "seed": seed}
                t0 = time.perf_counter()
                r = await http.post("/chat/completions", json=body)
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)
                tokens += r.json()["usage"]["completion_tokens"]

        before = batch_stats(url)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        after = batch_stats(url)
    return _level(concurrency, n_requests, wall, tokens, latencies, before, after)


def _level(concurrency: int, n_requests: int, wall: float, tokens: int, latencies: list[float],
           before: dict | None, after: dict | None) -> Level:
    mean_batch = mean_rows = None
    if before and after and after["batches"] > before["batches"]:
        mean_batch = (after["requests"] - before["requests"]) / (after["batches"] - before["batches"])
    if before and after and after.get("decode_steps", 0) > before.get("decode_steps", 0):
        steps = after["decode_steps"] - before["decode_steps"]
        rows = after["mean_rows_per_step"] * after["decode_steps"] - before["mean_rows_per_step"] * before["decode_steps"]
        mean_rows = rows / steps
    return Level(concurrency, n_requests, wall, tokens, latencies, mean_batch, mean_rows)


async def run_level(url: str, concurrency: int, n_requests: int, max_tokens: int, seed: int,
                    model: str = "tiny", prompts: list[str] = PROMPTS) -> Level:
    """Our ``openai:`` client (token ids and logprobs requested, as a trainer would)."""
    client = OpenAIClient(model, base_url=url, concurrency=concurrency, timeout_s=600)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=seed)
    next_i = 0
    latencies: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal next_i, tokens
        while next_i < n_requests:
            i = next_i
            next_i += 1
            turn = await client.generate([UserMessage(content=prompts[i % len(prompts)])], params=params)
            latencies.append(turn.latency_s or 0.0)
            tokens += turn.usage.completion_tokens

    before = batch_stats(url)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    after = batch_stats(url)
    await client.aclose()
    return _level(concurrency, n_requests, wall, tokens, latencies, before, after)


def in_process(model: Path, args: argparse.Namespace, prompts: list[str]) -> list[float]:
    """Requests/s of ``HFClient`` driven directly, at each concurrency (see the module docstring)."""
    import torch

    from closedloop.models.hf import HFClient

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    client = HFClient.from_pretrained(model, max_batch_size=args.max_batch_size, batch_wait_ms=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=args.seed)

    async def level(concurrency: int, n: int) -> float:
        next_i = 0

        async def worker() -> None:
            nonlocal next_i
            while next_i < n:
                i = next_i
                next_i += 1
                await client.generate([UserMessage(content=prompts[i % len(prompts)])], None, params)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - start)

    async def run() -> list[float]:
        await level(1, 2)  # warm-up
        out = [await level(c, args.requests) for c in args.concurrency]
        await client.aclose()
        return out

    return asyncio.run(run())


def batch_stats(url: str) -> dict | None:
    """The server's batching record (admissions, decode steps and rows), if it keeps one."""
    try:
        return httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json().get("batches")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None  # a peer without our /health record


def report(levels: list[Level], console: Console, title: str, peer: list[Level] | None = None,
           inproc: list[float] | None = None) -> None:
    base = levels[0].rps
    table = Table(title=title)
    cols = ["clients", "requests", "wall s", "req/s", "tok/s", "p50 lat s", "p95 lat s", "mean batch", "mean rows",
            f"req/s vs {levels[0].concurrency} client(s)"]
    if peer:
        cols += ["peer req/s", "peer tok/s", "peer p50 s", "ours / peer"]
    if inproc:
        cols += ["in-process req/s"]
    for col in cols:
        table.add_column(col, justify="right")
    for k, lv in enumerate(levels):
        lat = sorted(lv.latencies)
        p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
        row = [str(lv.concurrency), str(lv.requests), f"{lv.wall_s:.2f}", f"{lv.rps:.2f}", f"{lv.tps:.1f}",
               f"{statistics.median(lat):.3f}", f"{p95:.3f}",
               "-" if lv.mean_batch is None else f"{lv.mean_batch:.1f}",
               "-" if lv.mean_rows is None else f"{lv.mean_rows:.1f}", f"{lv.rps / base:.2f}x"]
        if peer:
            other = peer[k]
            row += [f"{other.rps:.2f}", f"{other.tps:.1f}", f"{statistics.median(other.latencies):.3f}",
                    f"{lv.rps / other.rps:.2f}x"]
        if inproc:
            row += [f"{inproc[k]:.2f}"]
        table.add_row(*row)
    console.print(table)


def measure(url: str, args: argparse.Namespace, model: str, prompts: list[str]) -> list[Level]:
    level = run_level_http if args.client == "http" else run_level
    asyncio.run(level(url, 1, 2, args.max_tokens, args.seed, model, prompts))  # warm-up: first-call costs
    return [asyncio.run(level(url, c, args.requests, args.max_tokens, args.seed, model, prompts))
            for c in args.concurrency]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


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
    ap.add_argument("--peer", choices=["transformers", "none"], default="transformers",
                    help="the peer server measured in the same run (transformers serve --continuous-batching)")
    ap.add_argument("--client", choices=["http", "closedloop"], default="http",
                    help="load generator: plain httpx requests (default), or our openai: client asking for token "
                         "ids and logprobs (heavier: on a small machine it can be the bottleneck for both servers)")
    ap.add_argument("--in-process", action="store_true",
                    help="also drive hf: directly in this process (no HTTP): the decode worker's ceiling")
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
    peer: list[Level] | None = None
    prompts = list(PROMPTS)
    try:
        if args.peer == "transformers":
            port = free_port()
            proc = start_peer(model, port, args.torch_threads or None)
            try:
                url = f"http://127.0.0.1:{port}/v1"
                prompts = asyncio.run(answerable(url, str(model), PROMPTS, args.max_tokens, args.seed))
                if not prompts:
                    raise RuntimeError("the peer answered none of the prompts")
                left_out = [p for p in PROMPTS if p not in prompts]
                if left_out:
                    console.print(f"left out (the peer answers them with a 500): {left_out}")
                peer = measure(url, args, str(model), prompts)
            finally:
                stop(proc)
        port = free_port()
        proc = start_server(model, port, args.max_tokens, args.max_batch_size, args.torch_threads or None)
        try:
            levels = measure(f"http://127.0.0.1:{port}/v1", args, "tiny", prompts)
        finally:
            stop(proc)
        inproc = in_process(model, args, prompts) if args.in_process else None
    finally:
        if tmp is not None:
            tmp.cleanup()
    report(levels, console, f"closedloop serve, hf:{model.name}, max_tokens={args.max_tokens}, temperature=0, "
                            f"max batch {args.max_batch_size}, torch threads {args.torch_threads or 'default'}, "
                            f"{os.cpu_count()} CPUs, {args.client} client" + ("; peer: transformers serve --continuous-batching"
                                                         if peer else ""), peer, inproc)
    if args.json:
        rows = lambda lvs: [{**asdict(lv), "rps": lv.rps, "tps": lv.tps} for lv in lvs or []]  # noqa: E731
        args.json.write_text(json.dumps({"closedloop": rows(levels), "peer": rows(peer), "in_process_rps": inproc},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
