"""Throughput of ``closedloop serve`` against ``transformers serve --continuous-batching``
under 1, 8 and 32 concurrent clients, on the same model, prompts and client, in one run.

Both servers are real CLIs in subprocesses (``python -m closedloop serve`` and transformers'
own ``serve``, each with one torch thread), driven over HTTP by the same load generator: an
``aiohttp`` session posting minimal chat-completion bodies (``--client closedloop`` uses our
``openai:`` backend with token ids and logprobs instead). Requests use greedy decoding and the
same ``max_tokens``; the ratio column is ours over the peer's requests/s at the same concurrency.
``hf:`` decodes with continuous batching: a request that arrives while others decode joins them
at the next step, and "mean rows" is how many rows its decode steps carried on average. The
server runs the model in an engine process (``--engine process``, the default of ``closedloop
serve``), so its HTTP loop and its decoder do not share a GIL; ``--engine thread`` measures the
single-process server. As ``closedloop serve`` does by default, the engine and the server are bound
to separate CPUs (``--engine-cpus none``: not), and repeated prompts join the batch from the prompt
cache, without a prefill pass (``--prompt-cache-tokens 0``: off). The load cycles through a few
prompts, so after the first wave every admission is a cache hit: the peer's paged cache shares the
blocks of repeated prompts too (``ContinuousBatchingConfig.allow_block_sharing``, on by default).

    python benchmarks/bench_serve.py                      # builds the tiny model into a temp dir
    python benchmarks/bench_serve.py --model /path/to/ckpt --concurrency 1 8 32 --requests 640
    python benchmarks/bench_serve.py --peer none          # ours only
    python benchmarks/bench_serve.py --in-process         # also hf: without HTTP: the decoder's ceiling

``--requests`` defaults to 640 per level: at 32 clients, a few hundred requests are a handful of
waves, and the ramp-up and the last, draining wave (fewer rows per step) weigh on the figure for
both servers; it is reported at 160 too in the issue notes. Both servers stay up for the whole
run and each level runs ``--repeat`` times (default 3) on each, interleaved round by round; the
table shows the run with the median requests/s, and the per-round ratios follow it. On a shared
2-core machine one run of a level varied by up to ±25% (measured), so a single run says little.

``--in-process`` adds a column: the same prompts and concurrencies through ``HFClient`` in this
process (no HTTP, no server, no load-generator process), i.e. what the decode worker alone
sustains.
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
from typing import IO, Awaitable, Callable

import httpx
from rich.console import Console
from rich.table import Table

from closedloop.messages import UserMessage
from closedloop.models import ModelError, SamplingParams
from closedloop.models.openai_client import OpenAIClient
from closedloop.models.prompt_cache import SERVE_PROMPT_CACHE_TOKENS

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
                 torch_threads: int | None, engine: str = "process", prompt_cache_tokens: int | None = None,
                 engine_cpus: str = "auto", device: str = "cpu") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "closedloop", "serve", "--model", f"hf:{model}", "--port", str(port),
           "--served-name", "tiny", "--max-tokens", str(max_tokens), "--max-batch-size", str(max_batch_size),
           "--engine", engine, "--engine-cpus", engine_cpus, "--device", device]
    if prompt_cache_tokens is not None:
        cmd += ["--prompt-cache-tokens", str(prompt_cache_tokens)]
    env = dict(os.environ)
    if torch_threads:
        cmd += ["--torch-threads", str(torch_threads)]
        env["OMP_NUM_THREADS"] = str(torch_threads)
    return spawn(cmd, env, port)


def start_peer(model: Path, port: int, torch_threads: int | None, device: str = "cpu",
               kv_blocks: int | None = None) -> subprocess.Popen:
    """``transformers serve MODEL --continuous-batching`` (paged attention, its own scheduler);
    ``kv_blocks`` caps its paged cache (``--cb-num-blocks``; None: its own sizing)."""
    cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--device", device, "--continuous-batching"]
    if kv_blocks is not None:
        cmd += ["--cb-num-blocks", str(kv_blocks)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if torch_threads:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    return spawn(cmd, env, port)


def spawn(cmd: list[str], env: dict[str, str], port: int) -> subprocess.Popen:
    """Start a server whose log goes to a temporary file, not a pipe: nobody reads a pipe while
    the load runs, and a server that logs each request (``transformers serve`` does) blocks once
    the pipe's buffer is full, which hung the peer after a few hundred requests."""
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
    try:
        return wait_up(proc, port, log)
    finally:
        log.close()  # the child keeps its own descriptor


def wait_up(proc: subprocess.Popen, port: int, log: IO[str]) -> subprocess.Popen:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read()[-4000:]}")
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
    """The plain load generator: one ``aiohttp`` session with ``concurrency`` keep-alive
    connections posting minimal chat-completion bodies (no logprobs, no token ids), so both servers
    get identical requests and the client process costs little.

    Why aiohttp and not httpx: against a server that answers at once (``ScriptedClient`` behind
    ``closedloop serve``'s app), one ``httpx.AsyncClient`` with 32 connections saturated a core at
    ~270 requests/s, while aiohttp sent ~3,500/s at half a core (``--client httpx`` keeps the old
    generator for comparison). With httpx, the figures at 32 clients measured the load generator."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url=url.rstrip("/") + "/", connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def post(body: dict) -> int:
            async with http.post("chat/completions", json=body) as r:
                r.raise_for_status()
                return (await r.json())["usage"]["completion_tokens"]

        return await _drive(url, concurrency, n_requests, max_tokens, seed, model, prompts, post)


async def run_level_httpx(url: str, concurrency: int, n_requests: int, max_tokens: int, seed: int,
                          model: str = "tiny", prompts: list[str] = PROMPTS) -> Level:
    """The earlier load generator, one ``httpx.AsyncClient`` (kept to compare: it is CPU-bound
    near 270 requests/s at 32 connections on this benchmark's machine)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def post(body: dict) -> int:
            r = await http.post("/chat/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        return await _drive(url, concurrency, n_requests, max_tokens, seed, model, prompts, post)


async def _drive(url: str, concurrency: int, n_requests: int, max_tokens: int, seed: int, model: str,
                 prompts: list[str], post: Callable[[dict], Awaitable[int]]) -> Level:
    """``concurrency`` clients, each posting its next request as soon as its last one is answered."""
    next_i = 0
    latencies: list[float] = []
    tokens = 0

    async def worker() -> None:
        nonlocal next_i, tokens
        while next_i < n_requests:
            i = next_i
            next_i += 1
            body = {"model": model, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                    "max_tokens": max_tokens, "temperature": 0.0, "seed": seed}
            t0 = time.perf_counter()
            n = await post(body)  # not `tokens += await ...`: that reads `tokens` before the await
            latencies.append(time.perf_counter() - t0)
            tokens += n

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
    client = HFClient.from_pretrained(model, device=args.device, max_batch_size=args.max_batch_size, batch_wait_ms=0,
                                      prompt_cache_tokens=SERVE_PROMPT_CACHE_TOKENS if args.prompt_cache_tokens is None
                                      else args.prompt_cache_tokens)
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


def measure(servers: dict[str, tuple[str, str]], args: argparse.Namespace,
            prompts: list[str]) -> dict[str, dict[int, list[Level]]]:
    """Every level ``args.repeat`` times on every server (name -> (url, model name)), interleaved:
    each round runs each concurrency on one server, then on the other (the order alternating by
    round), so a slow drift of the machine weighs on both alike. Both servers stay up throughout;
    an idle one costs no CPU (measured: 0.4% of a core for the peer)."""
    level = {"http": run_level_http, "httpx": run_level_httpx, "closedloop": run_level}[args.client]
    for url, model in servers.values():
        asyncio.run(level(url, 1, 2, args.max_tokens, args.seed, model, prompts))  # warm-up: first-call costs
    runs: dict[str, dict[int, list[Level]]] = {name: {c: [] for c in args.concurrency} for name in servers}
    names = list(servers)
    for r in range(args.repeat):
        for c in args.concurrency:
            for name in (names if r % 2 == 0 else names[::-1]):
                url, model = servers[name]
                runs[name][c].append(asyncio.run(level(url, c, args.requests, args.max_tokens, args.seed,
                                                       model, prompts)))
    return runs


def median_level(levels: list[Level]) -> Level:
    """The run with the median requests/s (the lower middle one for an even count)."""
    return sorted(levels, key=lambda lv: lv.rps)[(len(levels) - 1) // 2]


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
    ap.add_argument("--requests", type=int, default=640, help="requests per concurrency level")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each level on each server; the median is reported")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-batch-size", type=int, default=32, help="the server's micro-batch limit")
    # On a shared, oversubscribed CPU, OpenMP's spinning threads made a 2-thread decode 10-100x
    # slower than a 1-thread one (measured); 0 leaves torch's default.
    ap.add_argument("--torch-threads", type=int, default=1, help="server's torch threads (0: torch default)")
    ap.add_argument("--peer", choices=["transformers", "none"], default="transformers",
                    help="the peer server measured in the same run (transformers serve --continuous-batching)")
    ap.add_argument("--client", choices=["http", "httpx", "closedloop"], default="http",
                    help="load generator: plain aiohttp requests (default), the earlier httpx generator, or our "
                         "openai: client asking for token ids and logprobs (heavier: on a small machine it can be the bottleneck for both servers)")
    ap.add_argument("--engine", choices=["process", "thread"], default="process",
                    help="closedloop serve's --engine: the model in a child process (default) or on a server thread")
    ap.add_argument("--prompt-cache-tokens", type=int, default=None,
                    help="closedloop serve's --prompt-cache-tokens (default: serve's default; 0 turns the prompt "
                         "cache off)")
    ap.add_argument("--engine-cpus", choices=["auto", "none"], default="auto",
                    help="closedloop serve's --engine-cpus: bind the engine and the server to separate CPUs "
                         "(default, as serve) or leave placement to the OS")
    ap.add_argument("--device", default="cpu", help="both servers' torch device (cpu, cuda)")
    # On a CPU the peer sizes its paged cache from the machine's memory and faults it in at the first
    # request: 14 s of system time on a 2-core machine (measured), for a toy model's few tokens.
    ap.add_argument("--peer-kv-blocks", type=int, default=None,
                    help="cap the peer's paged KV cache (--cb-num-blocks; default: its own sizing)")
    ap.add_argument("--in-process", action="store_true",
                    help="also drive hf: directly in this process (no HTTP): the decode worker's ceiling")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.requests < 1:
        ap.error("--repeat and --requests must be at least 1")
    console = Console(width=max(Console().width, 110))

    tmp = None
    model = args.model
    if model is None:
        from closedloop.models.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="bench-serve-")
        console.print("building the tiny model ...")
        model = build_tiny_model(Path(tmp.name) / "tiny", seed=args.seed)
    prompts = list(PROMPTS)
    procs: list[subprocess.Popen] = []
    servers: dict[str, tuple[str, str]] = {}
    cache = None
    try:
        if args.peer == "transformers":
            port = free_port()
            procs.append(start_peer(model, port, args.torch_threads or None, args.device, args.peer_kv_blocks))
            url = f"http://127.0.0.1:{port}/v1"
            prompts = asyncio.run(answerable(url, str(model), PROMPTS, args.max_tokens, args.seed))
            if not prompts:
                raise RuntimeError("the peer answered none of the prompts")
            left_out = [p for p in PROMPTS if p not in prompts]
            if left_out:
                console.print(f"left out (the peer answers them with a 500): {left_out}")
            servers["peer"] = (url, str(model))
        port = free_port()
        procs.append(start_server(model, port, args.max_tokens, args.max_batch_size, args.torch_threads or None,
                                  args.engine, args.prompt_cache_tokens, args.engine_cpus, args.device))
        servers["closedloop"] = (f"http://127.0.0.1:{port}/v1", "tiny")
        runs = measure(servers, args, prompts)
        cache = (batch_stats(servers["closedloop"][0]) or {}).get("prompt_cache")
    finally:
        for proc in procs:
            stop(proc)
    inproc = None
    try:
        inproc = in_process(model, args, prompts) if args.in_process else None
    finally:
        if tmp is not None:
            tmp.cleanup()
    levels = [median_level(runs["closedloop"][c]) for c in args.concurrency]
    peer = [median_level(runs["peer"][c]) for c in args.concurrency] if "peer" in runs else None
    report(levels, console, f"closedloop serve, hf:{model.name}, max_tokens={args.max_tokens}, temperature=0, "
                            f"max batch {args.max_batch_size}, torch threads {args.torch_threads or 'default'}, "
                            f"{os.cpu_count()} CPUs, {args.client} client, {args.engine} engine "
                            f"(CPUs: {args.engine_cpus}), prompt cache "
                            f"{'default' if args.prompt_cache_tokens is None else args.prompt_cache_tokens}, "
                            f"median of {args.repeat} interleaved runs"
                            + ("; peer: transformers serve --continuous-batching" if peer else ""), peer, inproc)
    if peer:
        for c in args.concurrency:
            ratios = [a.rps / b.rps for a, b in zip(runs["closedloop"][c], runs["peer"][c])]
            console.print(f"{c} clients, ours / peer by round: " + ", ".join(f"{x:.2f}x" for x in ratios))
    if cache:
        console.print(f"closedloop prompt cache over the run: {cache['hits']} hits, {cache['misses']} misses")
    if args.json:
        rows = lambda lvs: [{**asdict(lv), "rps": lv.rps, "tps": lv.tps} for lv in lvs or []]  # noqa: E731
        args.json.write_text(json.dumps({"closedloop": rows(levels), "peer": rows(peer), "in_process_rps": inproc,
                                         "prompt_cache": cache,
                                         "runs": {name: {str(c): rows(lvs) for c, lvs in by_c.items()}
                                                  for name, by_c in runs.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
