"""Per-step overhead of the ``react`` graph against a raw LangGraph loop of the same shape.

Both graphs alternate model → tools for ``--turns`` model calls with a zero-latency model, in the
same process, so the ratio isolates what closedloop adds per step (typed messages, token-exact
turn records, tool validation and error capture) over bare LangGraph with dict messages.

    python benchmarks/bench_graph_overhead.py --turns 20 --repeats 30
"""

from __future__ import annotations

import argparse
import asyncio
import operator
import statistics
import time
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph
from rich.console import Console
from rich.table import Table

from closedloop.graphs.react import build_react_graph
from closedloop.messages import AssistantMessage, ToolCall, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.plugins import tool_registry


def closedloop_graph(turns: int):
    calls = [AssistantMessage(tool_calls=[ToolCall.make("add", {"a": i, "b": 1})]) for i in range(turns - 1)]
    client = ScriptedClient(calls + [AssistantMessage(content="done")], cycle=True)
    graph = build_react_graph(client, tool_registry(["arithmetic"]), max_turns=turns + 1)
    return graph, lambda: {"messages": [UserMessage(content="go")]}, client


class RawState(TypedDict, total=False):
    messages: Annotated[list[dict[str, Any]], operator.add]


def raw_graph(turns: int):
    """The same loop in bare LangGraph: dict messages, a direct function call as the tool."""
    counter = {"n": 0}

    async def model(state: RawState) -> dict:
        counter["n"] += 1
        if counter["n"] % turns == 0:
            return {"messages": [{"role": "assistant", "content": "done"}]}
        return {"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "add", "arguments": {"a": counter["n"], "b": 1}}}]}]}

    async def tools(state: RawState) -> dict:
        call = state["messages"][-1]["tool_calls"][0]
        args = call["function"]["arguments"]
        return {"messages": [{"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])}]}

    def route(state: RawState) -> str:
        return "tools" if state["messages"][-1].get("tool_calls") else END

    g = StateGraph(RawState)
    g.add_node("model", model)
    g.add_node("tools", tools)
    g.add_edge(START, "model")
    g.add_conditional_edges("model", route, {"tools": "tools", END: END})
    g.add_edge("tools", "model")
    return g.compile(), lambda: {"messages": [{"role": "user", "content": "go"}]}, None


async def time_graph(graph, make_input, turns: int, repeats: int) -> tuple[float, int]:
    """Median µs per super-step over ``repeats`` full episodes; also the step count."""
    per_step = []
    steps = 2 * turns - 1
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = await graph.ainvoke(make_input())
        dt = time.perf_counter() - t0
        if len(out["messages"]) != steps + 1:
            raise RuntimeError(f"expected {steps + 1} messages, got {len(out['messages'])}")
        per_step.append(dt / steps * 1e6)
    return statistics.median(per_step), steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    results = {}
    for name, factory in [("raw langgraph", raw_graph), ("closedloop react", closedloop_graph)]:
        graph, make_input, _ = factory(args.turns)
        asyncio.run(time_graph(graph, make_input, args.turns, 3))  # warm-up
        results[name] = asyncio.run(time_graph(graph, make_input, args.turns, args.repeats))
    table = Table(title=f"per-step overhead, {args.turns} model turns, median of {args.repeats}")
    table.add_column("graph")
    table.add_column("µs / super-step", justify="right")
    table.add_column("ratio vs raw", justify="right")
    base = results["raw langgraph"][0]
    for name, (us, _) in results.items():
        table.add_row(name, f"{us:,.0f}", f"{us / base:.2f}×")
    Console().print(table)


if __name__ == "__main__":
    main()
