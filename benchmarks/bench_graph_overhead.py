"""Per-step CPU of the ``react`` graph, with and without recording, against a raw LangGraph loop
of the same shape.

Every row runs the same episodes: ``--turns`` model calls of one :class:`ScriptedClient` (a
zero-latency replay model; ``turns - 1`` calls of ``add``, then an answer), so ``2·turns - 1``
super-steps, in the same process. The ratio is what closedloop adds per step (typed messages,
token-exact turn records, tool validation and error capture, recording) over bare LangGraph.

Rows:
- ``raw langgraph``: the peer. A ``StateGraph`` of plain dict messages (``operator.add``), a
  model node calling the same scripted client and turning its reply into an OpenAI dict, a tool
  node parsing the arguments and calling ``add``'s own function, a router on the last message.
- ``closedloop react``: ``graph.ainvoke`` with an :class:`AgentContext` (no recording).
- ``closedloop react + recording``: ``run_graph`` with a :class:`StoreRecorder` on a real DuckDB
  run store (what ``closedloop run`` does), one run per block.
- with ``--langchain``: the prebuilt ``ToolNode``/``tools_condition`` graph with a raw model
  node, with our model node, and with ``ClosedloopChatModel`` (LangChain's chat-model path).

How it is measured, so that no row's work lands in another's:
- a block is ``--episodes`` episodes of one row; its CPU is the process's CPU time
  (``time.process_time``: every thread, so the store's background writer counts) and its wall
  time, read before the first episode and after the last. A recording block ends with
  ``recorder.flush()`` inside the timed region: the writer's work for that block is done (and
  counted) when the clock stops, and none of it spills into the next block.
- rows are interleaved: each round runs one block of every row, in an order that rotates per
  round, after a warm-up round; garbage is collected before each block (outside the clock).
- reported: the median per-step CPU and wall time of each row, and the median over rounds of
  each round's ratio to the raw block (blocks of one round ran seconds apart, under the same
  load); the load average before and after; what one commit of the run store costs.
- block size: a commit has a fixed cost (tens of ms of CPU, printed) that a block's closing flush
  pays once more; 50 episodes (1,950 steps) make it one of several commits, as in a run that
  streams steps. Smaller blocks show that cost per step (``--episodes 5`` gave 2.9× against 2.1× for the
  recording row in one run at load 8); it is a cost per run, not per step.

    python benchmarks/bench_graph_overhead.py --turns 20 --episodes 50 --rounds 9
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import operator
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Awaitable, Callable, TypedDict

from langgraph.graph import END, START, StateGraph
from rich.console import Console
from rich.table import Table

from closedloop.graphs.react import graph as react_graph
from closedloop.messages import AssistantMessage, ToolCall, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.plugins import tool_registry
from closedloop.runtime import AgentContext
from closedloop.store import RunStore


MAX_PENDING = RunStore.__init__.__kwdefaults__["max_queued_steps"]  # type: ignore[index]


def scripted(turns: int) -> ScriptedClient:
    """The model of every row: ``turns - 1`` calls of ``add``, then an answer, cycling."""
    calls = [AssistantMessage(tool_calls=[ToolCall.make("add", {"a": i, "b": 1})]) for i in range(turns - 1)]
    return ScriptedClient(calls + [AssistantMessage(content="done")], cycle=True)


@dataclass
class Row:
    """One benchmarked graph: ``episode()`` runs one episode and returns its final messages;
    ``start_block``/``end_block`` bracket a block (``end_block`` is timed: the recorder's flush)."""

    name: str
    episode: Callable[[], Awaitable[list[Any]]]
    start_block: Callable[[], None] = lambda: None
    end_block: Callable[[], None] = lambda: None
    cpu_us: list[float] = field(default_factory=list)
    wall_us: list[float] = field(default_factory=list)
    commit_ms: Callable[[], float] | None = None  # the store's fixed cost per commit (recording rows)


class RawState(TypedDict, total=False):
    messages: Annotated[list[dict[str, Any]], operator.add]


def raw_row(turns: int) -> Row:
    """The peer: the same loop in bare LangGraph with plain dict messages."""
    client = scripted(turns)
    add = tool_registry(["arithmetic"]).get("add").fn

    async def model(state: RawState) -> dict[str, Any]:
        turn = await client.generate(state["messages"])  # type: ignore[arg-type]  # the client only keeps them
        m = turn.message
        reply: dict[str, Any] = {"role": "assistant", "content": m.content}
        if m.tool_calls:
            reply["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                   for c in m.tool_calls]
        return {"messages": [reply]}

    async def tools(state: RawState) -> dict[str, Any]:
        out = []
        for call in state["messages"][-1]["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            out.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(add(**args))})
        return {"messages": out}

    def route(state: RawState) -> str:
        return "tools" if state["messages"][-1].get("tool_calls") else END

    g = StateGraph(RawState)
    g.add_node("model", model)
    g.add_node("tools", tools)
    g.add_edge(START, "model")
    g.add_conditional_edges("model", route, {"tools": "tools", END: END})
    g.add_edge("tools", "model")
    graph = g.compile()

    async def episode() -> list[Any]:
        client.calls.clear()
        return (await graph.ainvoke({"messages": [{"role": "user", "content": "go"}]}))["messages"]

    return Row("raw langgraph", episode)


def react_context(turns: int) -> AgentContext:
    return AgentContext(client=scripted(turns), tools=tool_registry(["arithmetic"]), max_turns=turns + 1)


def react_row(turns: int) -> Row:
    context = react_context(turns)
    assert isinstance(context.client, ScriptedClient)
    client = context.client

    async def episode() -> list[Any]:
        client.calls.clear()
        out = await react_graph.ainvoke({"messages": [UserMessage(content="go")]}, context=context)
        return out["messages"]

    return Row("closedloop react", episode)


def recorded_row(turns: int, store_dir: str) -> Row:
    """``react`` through ``run_graph`` with a ``StoreRecorder`` (what ``closedloop run`` does).

    One run per block, started outside the clock (a run's start and finish are one transaction
    each, per run, not per step); the block ends with ``recorder.flush()``, timed, so every step
    it recorded is committed, by this thread or the writer's, before the clock stops."""
    from closedloop.runtime.execute import run_graph
    from closedloop.runtime.recording import StoreRecorder

    context = react_context(turns)
    assert isinstance(context.client, ScriptedClient)
    client = context.client
    store = RunStore(os.path.join(store_dir, "runs.duckdb"))
    recorder: list[StoreRecorder] = []

    def start_block() -> None:
        if recorder:
            store.finish_run(recorder[0].run_id, status="completed")
        recorder[:] = [StoreRecorder(store, store.start_run(kind="run", graph="react", model_spec=client.spec))]

    async def episode() -> list[Any]:
        client.calls.clear()
        run = await run_graph(react_graph, {"messages": [UserMessage(content="go")]}, context=context,
                              recorder=recorder[0])
        return run.state["messages"]

    def commit_ms() -> float:
        """CPU of one commit of a one-message step: the part of a batch that does not depend on
        its size (opening the file, the statements, closing), spread over the steps of a batch."""
        costs = []
        for _ in range(5):
            start_block()
            store.log_step(recorder[0].run_id, [UserMessage(content="x")])
            c0 = time.process_time()
            store.flush()
            costs.append((time.process_time() - c0) * 1e3)
        return statistics.median(costs)

    return Row("closedloop react + recording", episode, start_block, lambda: recorder[0].flush(), commit_ms=commit_ms)


def toolnode_rows(turns: int) -> list[Row]:
    """``model ⇄ ToolNode`` with ``tools_condition``; the model is a raw node returning
    ``AIMessage``s from the scripted client, our model node, or ``ClosedloopChatModel``."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import MessagesState
    from langgraph.prebuilt import ToolNode, tools_condition

    from closedloop.langchain_chat import ClosedloopChatModel
    from closedloop.langchain_tools import to_langchain_tool
    from closedloop.runtime import AgentState, model_node

    tools = tool_registry(["arithmetic"])
    lc_tools = [to_langchain_tool(t) for t in tools]
    rows = []
    for kind in ("raw", "ours", "chat"):
        client = scripted(turns)

        async def raw_model(state: Any, client: ScriptedClient = client) -> dict[str, Any]:
            m = (await client.generate(state["messages"])).message
            return {"messages": [AIMessage(content=m.content or "", tool_calls=[
                {"name": c.name, "args": c.parsed_arguments(), "id": c.id} for c in m.tool_calls or []])]}

        node: Any = raw_model
        schema: Any = MessagesState
        if kind == "chat":
            llm = ClosedloopChatModel.from_client(client).bind_tools(lc_tools)

            async def node(state: Any, llm: Any = llm) -> dict[str, Any]:
                return {"messages": [await llm.ainvoke(state["messages"])]}
        elif kind == "ours":
            node, schema = model_node, AgentState
        g = StateGraph(schema, context_schema=AgentContext if kind == "ours" else None)
        g.add_node("model", node)
        g.add_node("tools", ToolNode(lc_tools))
        g.add_edge(START, "model")
        g.add_conditional_edges("model", tools_condition)
        g.add_edge("tools", "model")
        graph = g.compile()
        context = AgentContext(client=client, tools=tools, max_turns=turns + 1) if kind == "ours" else None

        async def episode(graph: Any = graph, context: Any = context, client: ScriptedClient = client) -> list[Any]:
            client.calls.clear()
            out = await graph.ainvoke({"messages": [HumanMessage(content="go")]}, context=context)
            return out["messages"]

        name = {"raw": "raw + ToolNode", "ours": "our model node + ToolNode",
                "chat": "LangChain chat model + ToolNode"}[kind]
        rows.append(Row(name, episode))
    return rows


async def run_block(row: Row, episodes: int, steps: int) -> tuple[float, float]:
    """One block of ``row``: µs of process CPU and of wall time per super-step."""
    row.start_block()
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(episodes):
        messages = await row.episode()
        if len(messages) != steps + 1:
            raise RuntimeError(f"{row.name}: expected {steps + 1} messages, got {len(messages)}")
    row.end_block()
    c1, t1 = time.process_time(), time.perf_counter()
    n = episodes * steps
    return (c1 - c0) / n * 1e6, (t1 - t0) / n * 1e6


async def measure(rows: list[Row], episodes: int, rounds: int, steps: int) -> None:
    for r in range(rounds + 1):  # round 0 warms up (imports, caches, the store's first writes)
        k = r % len(rows)
        for row in rows[k:] + rows[:k]:  # each row takes each position in turn
            cpu, wall = await run_block(row, episodes, steps)
            if r:
                row.cpu_us.append(cpu)
                row.wall_us.append(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20, help="model calls per episode")
    ap.add_argument("--episodes", type=int, default=50, help="episodes per timed block")
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds (each runs one block of every row)")
    ap.add_argument("--langchain", action="store_true", help="also the ToolNode / LangChain chat-model rows")
    args = ap.parse_args()
    steps = 2 * args.turns - 1
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-graph-") as tmp:
        rows = [raw_row(args.turns), react_row(args.turns), recorded_row(args.turns, tmp)]
        if args.langchain:
            rows += toolnode_rows(args.turns)
        asyncio.run(measure(rows, args.episodes, args.rounds, steps))
        commit = {row.name: row.commit_ms() for row in rows if row.commit_ms is not None}
    load_after = os.getloadavg()

    base = rows[0]
    table = Table(title=f"per super-step, {args.turns} model turns ({steps} steps) per episode, blocks of "
                        f"{args.episodes} episodes, median of {args.rounds} interleaved rounds")
    for col in ("graph", "CPU µs / step", "CPU vs raw", "wall µs / step", "wall vs raw"):
        table.add_column(col, justify="left" if col == "graph" else "right")
    for row in rows:
        cpu_ratio = statistics.median(c / b for c, b in zip(row.cpu_us, base.cpu_us))
        wall_ratio = statistics.median(w / b for w, b in zip(row.wall_us, base.wall_us))
        table.add_row(row.name, f"{statistics.median(row.cpu_us):,.0f}", f"{cpu_ratio:.2f}×",
                      f"{statistics.median(row.wall_us):,.0f}", f"{wall_ratio:.2f}×")
    console = Console()
    console.print(table)
    console.print("CPU: process CPU time, all threads (the store's writer included; each recording block ends "
                  "with a flush inside the clock). Ratios: median over rounds of block / raw block of that round.")
    for name, ms in commit.items():
        console.print(f"{name}: one commit of the run store costs {ms:.1f} ms CPU whatever its size (its writer "
                      f"commits at most {MAX_PENDING} queued steps at a time, so at least {ms / MAX_PENDING * 1e3:.0f} "
                      f"µs a step at full speed; each block ends with one more, {ms / (args.episodes * steps) * 1e3:.0f} "
                      f"µs a step here)")
    console.print("load average (1, 5, 15 min): before " + ", ".join(f"{x:.2f}" for x in load_before)
                  + "; after " + ", ".join(f"{x:.2f}" for x in load_after) + f"; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
