"""What the viewer's pages cost on a big store: 10,000 runs and 1,000,000 turns.

The store (built once, kept at ``--store``): ``--runs`` runs with ``--turns`` turns in all,
written through ``RunStore.record_trajectories`` in batches (the trainers' path): interactive runs,
evaluations with episodes, training runs with rollouts, tags, and one run of ``--trace-turns``
(200) turns with a tool call after each turn. Each turn has ``--tokens`` token ids (prompt +
completion), logprobs and a loss mask.

Measured, interleaved in one process for ``--repeats`` rounds (each round every case once, in
turn, so the machine's load falls on all cases alike):

- ``runs page``: ``GET /`` (top-level runs, facets, total; one transaction);
- ``trace 200``: ``GET /runs/<the 200-turn run>``;
- peers, the store reads the CLI does for the same views: ``RunStore.list_runs(limit=50)``
  (``closedloop runs list``) and ``RunStore.get_run`` of the 200-turn run (``closedloop runs show``).

Server time is the app's own ``Server-Timing`` header (request in, response out, inside the
server); CPU is this process's ``time.process_time`` over the request (every thread: the server's,
DuckDB's, the in-process client's). Reported: median (and worst) of each, the ratio page/peer,
and the load average before and after. Goal: each page ≤ 300 ms server time.

    python benchmarks/bench_ui.py --store out/bench_ui/runs.duckdb --repeats 15

Measured (2026-12, 2-core shared machine, 10,000 runs / 1,000,073 turns, 72 MiB; build 290 s),
21 rounds at load 7.7-8.4: runs page 128 ms server time (47 ms CPU; peer list_runs 81 ms, 27 ms
CPU), trace 291 ms (95 ms CPU; peer get_run 159 ms, 52 ms CPU), worst 212 / 446 ms. 15 rounds at
load 12: 184 / 401 ms (48 / 104 ms CPU): the trace page meets the goal at load 8 and misses it at 12,
where wall time is 3-4x CPU. About 20 ms of CPU per page is DuckDB opening the file (the viewer
never keeps it open); the trace page opens it twice (sub-runs and version, then the run).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from closedloop.messages import (AssistantMessage, LogprobSpec, SystemMessage, ToolCall, ToolMessage, Trajectory,
                                 Turn, Usage, UserMessage)
from closedloop.store import RunStore

KINDS = ("run", "eval", "train")


def _turn(i: int, tokens: int, tool: bool) -> tuple[Turn, list]:
    n_prompt = tokens * 3 // 4
    n_completion = tokens - n_prompt
    call = ToolCall.make("add", {"a": i, "b": 1}, id=f"call_{i}") if tool else None
    message = AssistantMessage(content=None if tool else f"the answer is {i}", tool_calls=[call] if call else None)
    turn = Turn.model_construct(message=message, model="hf:bench", prompt_ids=list(range(i, i + n_prompt)),
                                completion_ids=list(range(n_completion)), logprobs=[-0.25] * n_completion,
                                loss_mask=[0] * n_prompt + [1] * n_completion, logprob_spec=LogprobSpec(backend="hf"),
                                completion_text=f"step {i}", finish_reason="tool_calls" if tool else "stop",
                                usage=Usage(prompt_tokens=n_prompt, completion_tokens=n_completion), latency_s=0.01,
                                trainable=True, purpose="policy", unavailable={}, media=[])
    extra = [ToolMessage(tool_call_id=call.id, content=str(i + 1), name="add")] if call else []
    return turn, [message, *extra]


def _trajectory(n_turns: int, tokens: int, seed: int, tools: bool) -> Trajectory:
    messages = [SystemMessage(content="You are a calculator agent."), UserMessage(content=f"What is {seed}?")]
    turns = []
    for i in range(n_turns):
        t, ms = _turn(seed + i, tokens, tools and i < n_turns - 1)
        turns.append(t)
        messages += ms
    return Trajectory(messages=messages, turns=turns, rewards={"success": float(seed % 2)}, metadata={"seed": seed})


def build(path: Path, runs: int, turns: int, trace_turns: int, tokens: int, console: Console) -> str:
    """The store, unless ``path`` already holds one of this size; returns the long run's id."""
    store = RunStore(path)
    existing = store.list_runs(limit=None, tag="bench:trace")
    if existing:
        console.print(f"reusing {path}")
        return existing[0].id
    rng = random.Random(0)
    t0 = time.perf_counter()
    long_run = _trajectory(trace_turns, tokens, 0, tools=True)
    store.record_trajectories([long_run], kind="run", graph="react", model_spec="hf:bench", tags=["bench:trace"])
    left_runs, left_turns = runs - 1, turns - trace_turns
    parents: dict[str, str] = {}
    for kind in ("eval", "train"):
        for k in range(20):
            parents[f"{kind}{k}"] = store.start_run(kind=kind, graph="react" if kind == "eval" else None,
                                                    model_spec="hf:bench", tags=[f"bench:{kind}"])
            left_runs -= 1
    batch_runs = 100
    made = 0
    while left_runs > 0:
        n = min(batch_runs, left_runs)
        per = max(1, left_turns // left_runs)
        trajs = [_trajectory(max(1, min(2 * per - 1, per + rng.randint(-per // 2, per // 2))), tokens, made + j,
                             tools=True) for j in range(n)]
        kind = KINDS[(made // batch_runs) % 3]
        parent = None if kind == "run" else parents[f"{kind}{(made // batch_runs) % 20}"]
        child_kind = {"run": "run", "eval": "episode", "train": "rollout"}[kind]
        store.record_trajectories(trajs, kind=child_kind, graph="react", model_spec="hf:bench", parent_id=parent,
                                  tags=[f"batch:{made // batch_runs}"])
        made += n
        left_runs -= n
        left_turns -= sum(len(t.turns) for t in trajs)
        if made % 1000 == 0:
            console.print(f"  {made} runs written ({time.perf_counter() - t0:.0f} s)")
    for rid in parents.values():
        store.finish_run(rid, "completed")
    store.close()
    console.print(f"built {path} in {time.perf_counter() - t0:.0f} s")
    return long_run.id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="out/bench_ui/runs.duckdb")
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--turns", type=int, default=1_000_000)
    ap.add_argument("--trace-turns", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64, help="token ids per turn (prompt + completion)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    console = Console()
    path = Path(args.store)
    path.parent.mkdir(parents=True, exist_ok=True)
    long_id = build(path, args.runs, args.turns, args.trace_turns, args.tokens, console)

    from fastapi.testclient import TestClient

    from closedloop.ui.app import UISettings, create_app

    app = create_app(UISettings(store=str(path)))
    store: RunStore = app.state.store
    client = TestClient(app, base_url="http://127.0.0.1")
    counts = store._tx(lambda con: con.execute("SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM turns)")
                       .fetchone())
    console.print(f"store: {counts[0]:,} runs, {counts[1]:,} turns, {path.stat().st_size / 2**20:.0f} MiB")

    def page(url: str):
        def go() -> float:
            r = client.get(url)
            assert r.status_code == 200, (url, r.status_code, r.text[:300])
            return float(r.headers["server-timing"].split("dur=")[1]) / 1000
        return go

    def peer(fn):
        def go() -> float:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        return go

    cases = {"runs page (GET /)": page("/"), "trace 200 (GET /runs/ID)": page(f"/runs/{long_id}"),
             "peer: RunStore.list_runs(limit=50)": peer(lambda: store.list_runs(limit=50)),
             "peer: RunStore.get_run(200-turn run)": peer(lambda: store.get_run(long_id))}
    for fn in cases.values():  # warm: templates compiled, modules imported
        fn()
    load_before = os.getloadavg()
    server: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            c0 = time.process_time()
            server[name].append(fn())
            cpu[name].append(time.process_time() - c0)
    load_after = os.getloadavg()
    table = Table(title=f"viewer on {counts[0]:,} runs / {counts[1]:,} turns, {args.repeats} interleaved rounds "
                        f"(load {load_before[0]:.1f} → {load_after[0]:.1f}, {os.cpu_count()} CPUs)")
    for col in ("case", "server ms (median)", "worst", "CPU ms (median)", "goal"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for name in cases:
        goal = "≤ 300" if "page" in name or "trace" in name else ""
        table.add_row(name, f"{statistics.median(server[name]) * 1000:.1f}", f"{max(server[name]) * 1000:.1f}",
                      f"{statistics.median(cpu[name]) * 1000:.1f}", goal)
    console.print(table)
    names = list(cases)
    for a, b in ((names[0], names[2]), (names[1], names[3])):
        console.print(f"{a} / {b}: server {statistics.median(server[a]) / statistics.median(server[b]):.2f}×, "
                      f"CPU {statistics.median(cpu[a]) / statistics.median(cpu[b]):.2f}×")


if __name__ == "__main__":
    main()
