"""τ runner throughput: episodes per minute at concurrency 1, 8 and 32 against a model server
with a fixed 200 ms response latency.

The runner's claim is that episodes overlap: while one waits on a model call the others run, so
episodes/min should grow with concurrency until the CPU-bound parts (building environments, the
DB replays of grading, store writes) saturate the one event loop. The model is a scripted
``ModelClient`` that sleeps ``--latency`` seconds per call, served by ``closedloop.server`` under
uvicorn in a separate process; the agent (the ``react`` graph) and the user simulator both reach
it through the ``openai:`` backend, so the figure includes HTTP, the graph, the orchestrator,
grading and the DuckDB writes. Each episode is four model calls: the user's opening, the agent's
``get_user_details`` call, the agent's closing text, and the user's ``###STOP###``.

    python benchmarks/bench_tau_runner.py                               # anchors' retail DB
    python benchmarks/bench_tau_runner.py --data-dir /path/to/tau2-data --concurrency 1 8 32
    python benchmarks/bench_tau_runner.py --small                       # a 1-user DB: runner overhead only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from closedloop.evals.tau.orchestrator import STOP
from closedloop.messages import AssistantMessage, ToolCall, ToolMessage, Turn, Usage
from closedloop.models.base import ModelClient

REPO = Path(__file__).resolve().parents[1]


class LatencyClient(ModelClient):
    """Answers after a fixed delay. With tools (the agent): look the user up, then close. Without
    (the user simulator, roles flipped): the reason for calling, then ``###STOP###``."""

    spec = "latency"

    def __init__(self, latency_s: float, user_id: str) -> None:
        self.latency_s, self.user_id = latency_s, user_id

    async def generate(self, messages, tools=None, params=None, tool_choice=None) -> Turn:
        await asyncio.sleep(self.latency_s)
        if tools:
            if isinstance(messages[-1], ToolMessage):
                msg = AssistantMessage(content="I found your account; your details are up to date.")
            else:
                msg = AssistantMessage(tool_calls=[ToolCall.make("get_user_details", {"user_id": self.user_id})])
        else:
            spoken = any(m.role == "assistant" for m in messages)
            msg = AssistantMessage(content=STOP if spoken else "Hi, can you check my account details?")
        return Turn(message=msg, model=self.spec, usage=Usage(prompt_tokens=100, completion_tokens=10),
                    finish_reason="tool_calls" if msg.tool_calls else "stop")


def serve(port: int, latency_s: float, user_id: str) -> None:
    import uvicorn

    from closedloop.server import create_app

    uvicorn.run(create_app(LatencyClient(latency_s, user_id), "bench"), host="127.0.0.1", port=port,
                log_level="warning", lifespan="off")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_root(folder: Path) -> Path:
    """A retail root with one user and one order: environments and grading cost almost nothing."""
    addr = {"address1": "1 Main St", "address2": "", "city": "Springfield", "country": "USA", "state": "IL",
            "zip": "60601"}
    item = {"name": "Mug", "product_id": "900", "item_id": "1001", "price": 10.0, "options": {"color": "red"}}
    db = {"products": {"900": {"name": "Mug", "product_id": "900", "variants": {
              "1001": {"item_id": "1001", "options": {"color": "red"}, "available": True, "price": 10.0}}}},
          "users": {"ada_1": {"user_id": "ada_1", "name": {"first_name": "Ada", "last_name": "Lovelace"},
                              "address": addr, "email": "ada@example.com", "payment_methods": {
                                  "credit_card_1": {"source": "credit_card", "id": "credit_card_1", "brand": "visa",
                                                    "last_four": "4242"}}, "orders": ["#W1"]}},
          "orders": {"#W1": {"order_id": "#W1", "user_id": "ada_1", "address": addr, "items": [item],
                             "status": "pending", "fulfillments": [], "payment_history": [
                                 {"transaction_type": "payment", "amount": 10.0,
                                  "payment_method_id": "credit_card_1"}]}}}
    tasks = [{"id": f"t{i}", "user_scenario": {"instructions": {
                  "domain": "retail", "reason_for_call": "Check my account.", "known_info": "You are Ada Lovelace.",
                  "task_instructions": "Be brief."}},
              "evaluation_criteria": {"actions": [{"action_id": f"t{i}_0", "name": "get_user_details",
                                                   "arguments": {"user_id": "ada_1"}}], "reward_basis": ["DB"]}}
             for i in range(8)]
    domain = folder / "tau2" / "domains" / "retail"
    domain.mkdir(parents=True, exist_ok=True)
    (domain / "db.json").write_text(json.dumps(db))
    (domain / "tasks.json").write_text(json.dumps(tasks))
    (domain / "policy.md").write_text("# Retail agent policy\nHelp the user with their account.")
    return folder


@dataclass
class Level:
    concurrency: int
    episodes: int
    wall_s: float
    mean_episode_s: float
    avg_reward: float | None
    terminations: dict[str, int]

    @property
    def per_minute(self) -> float:
        return self.episodes / self.wall_s * 60


async def run_level(data: Any, tasks: list, url: str, store: Any, concurrency: int, episodes: int,
                    workers: int | None = None) -> Level:
    from closedloop.evals.tau.agents import make_agent_factory
    from closedloop.evals.tau.runner import EvalSettings, TauRunner
    from closedloop.models import SamplingParams, make_client

    spec = f"openai:bench@{url}"
    trials = max(1, -(-episodes // len(tasks)))
    chosen = tasks[: -(-episodes // trials)]
    agent_client, user_client = make_client(spec), make_client(spec)
    settings = EvalSettings(name=f"bench-c{concurrency}-{time.time_ns()}", domain="retail", agent="react",
                            model=spec, user_model=spec, trials=trials, concurrency=concurrency, max_steps=20,
                            workers=workers)
    factories = {k: make_agent_factory("react", agent_client, params=SamplingParams(temperature=0.0, max_tokens=64,
                                                                                      seed=s))
                 for k, s in enumerate(settings.seeds)}
    runner = TauRunner(settings, chosen, data, store, agents=factories.__getitem__, user_for=lambda task: user_client)
    try:
        start = time.perf_counter()
        report = await runner.run()
        wall = time.perf_counter() - start
    finally:
        await agent_client.aclose()
        await user_client.aclose()
    sims = report.simulations
    reasons: dict[str, int] = {}
    for s in sims:
        reasons[s.termination_reason.value] = reasons.get(s.termination_reason.value, 0) + 1
    return Level(concurrency, len(sims), wall, sum(s.duration for s in sims) / len(sims), report.metrics.avg_reward,
                 reasons)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("TAU2_DATA_DIR") or str(REPO.parent / "shared" / "anchors"))
    p.add_argument("--small", action="store_true", help="a generated 1-user retail DB instead of --data-dir")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--episodes", type=int, nargs="+", default=[32, 32, 64],
                   help="episodes per level (one value for all, or one per --concurrency value)")
    p.add_argument("--latency", type=float, default=0.2, help="seconds per model response")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--workers", type=int, default=None,
                   help="grading processes (default: by concurrency, see closedloop.evals.tau.workers; 0: none)")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: run the model server on this port
    p.add_argument("--user-id", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.latency, args.user_id)
        return 0
    episodes = args.episodes * len(args.concurrency) if len(args.episodes) == 1 else args.episodes
    if len(episodes) != len(args.concurrency):
        p.error("give one --episodes value, or one per --concurrency value")

    from closedloop.evals.tau import load_domain
    from closedloop.store import RunStore

    with tempfile.TemporaryDirectory() as tmp:
        root = small_root(Path(tmp) / "data") if args.small else Path(args.data_dir)
        data = load_domain("retail", root)
        tasks = data.load_tasks("base").tasks
        user_id = next(iter(data.make_environment().db.users))
        port = free_port()
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--latency", str(args.latency),
                                   "--user-id", user_id])
        try:
            url = f"http://127.0.0.1:{port}/v1"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url.removesuffix("/v1") + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the model server did not start")
                time.sleep(0.2)
            store = RunStore(Path(tmp) / "runs.duckdb")
            levels = [asyncio.run(run_level(data, tasks, url, store, c, n, args.workers))
                      for c, n in zip(args.concurrency, episodes)]
        finally:
            server.terminate()
            server.wait(timeout=10)

    base = levels[0].per_minute
    table = Table(title=f"τ runner: react + user over openai: at {args.latency * 1000:.0f} ms/response "
                        f"({'small DB' if args.small else root})")
    for col in ("concurrency", "episodes", "wall s", "episodes/min", "speed-up", "mean episode s", "avg reward",
                "terminations"):
        table.add_column(col, justify="right" if col != "terminations" else "left")
    for lv in levels:
        table.add_row(str(lv.concurrency), str(lv.episodes), f"{lv.wall_s:.1f}", f"{lv.per_minute:.1f}",
                      f"{lv.per_minute / base:.2f}x", f"{lv.mean_episode_s:.2f}",
                      "-" if lv.avg_reward is None else f"{lv.avg_reward:.2f}",
                      ", ".join(f"{k}: {v}" for k, v in sorted(lv.terminations.items())))
    Console(width=max(Console().width, 130)).print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"latency_s": args.latency, "small": args.small,
                                               "levels": [{**asdict(lv), "per_minute": lv.per_minute}
                                                          for lv in levels]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
