"""Per-step overhead of the ``react`` graph against a raw LangGraph loop of the same shape.

All graphs alternate model → tools for ``--turns`` model calls with a zero-latency model, in the
same process, so the ratio isolates what closedloop adds per step (typed messages, token-exact
turn records, tool validation and error capture) over bare LangGraph with dict messages.

Rows (episodes of all rows are interleaved, so load from other processes hits them alike):
- ``raw langgraph``: the peer: dict messages, the tool called inline, a sync router;
- ``closedloop react``: ``graph.ainvoke``; ``+ recording``: ``run_graph`` with a ``StoreRecorder``
  on a real DuckDB run store (what ``closedloop run`` does);
- ``raw + ToolNode``: the peer with LangGraph's prebuilt ``ToolNode``/``tools_condition`` and
  LangChain messages (how LangGraph users write it);
- ``LangChain chat model``: ``ClosedloopChatModel`` (same scripted client) bound to tools, in
  the ``ToolNode``/``tools_condition`` graph, against ``our model node`` in the same graph.

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

from closedloop.graphs.react import graph as react_graph
from closedloop.messages import AssistantMessage, ToolCall, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.plugins import tool_registry
from closedloop.runtime import AgentContext


def closedloop_graph(turns: int):
    calls = [AssistantMessage(tool_calls=[ToolCall.make("add", {"a": i, "b": 1})]) for i in range(turns - 1)]
    client = ScriptedClient(calls + [AssistantMessage(content="done")], cycle=True)
    context = AgentContext(client=client, tools=tool_registry(["arithmetic"]), max_turns=turns + 1)
    return WithContext(react_graph, context), lambda: {"messages": [UserMessage(content="go")]}, client


class WithContext:
    """A graph invoked with one run context (how every closedloop graph runs)."""

    def __init__(self, graph, context):
        self.graph, self.context = graph, context

    async def ainvoke(self, graph_input):
        return await self.graph.ainvoke(graph_input, context=self.context)


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


def toolnode_graph(turns: int, model: str = "raw"):
    """``model ⇄ ToolNode`` with ``tools_condition``; the model is a raw node returning AIMessages,
    ``ClosedloopChatModel`` over a scripted client, or our model node."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.graph import MessagesState
    from langgraph.prebuilt import ToolNode, tools_condition

    from closedloop.langchain_chat import ClosedloopChatModel
    from closedloop.langchain_tools import to_langchain_tool
    from closedloop.runtime import AgentState, model_node

    tools = tool_registry(["arithmetic"])
    lc_tools = [to_langchain_tool(t) for t in tools]
    calls = [AssistantMessage(tool_calls=[ToolCall.make("add", {"a": i, "b": 1})]) for i in range(turns - 1)]
    client = ScriptedClient(calls + [AssistantMessage(content="done")], cycle=True)
    counter = {"n": 0}

    async def raw_model(state) -> dict:
        counter["n"] += 1
        if counter["n"] % turns == 0:
            return {"messages": [AIMessage(content="done")]}
        return {"messages": [AIMessage(content="", tool_calls=[
            {"name": "add", "args": {"a": counter["n"], "b": 1}, "id": f"c{counter['n']}"}])]}

    if model == "chat":
        llm = ClosedloopChatModel.from_client(client).bind_tools(lc_tools)

        async def node(state) -> dict:
            return {"messages": [await llm.ainvoke(state["messages"])]}
        schema: Any = MessagesState
    elif model == "ours":
        node, schema = model_node, AgentState
    else:
        node, schema = raw_model, MessagesState
    g = StateGraph(schema, context_schema=AgentContext if model == "ours" else None)
    g.add_node("model", node)
    g.add_node("tools", ToolNode(lc_tools))
    g.add_edge(START, "model")
    g.add_conditional_edges("model", tools_condition)
    g.add_edge("tools", "model")
    compiled: Any = g.compile()
    if model == "ours":
        compiled = WithContext(compiled, AgentContext(client=client, tools=tools))
    return compiled, lambda: {"messages": [HumanMessage(content="go")]}, None


def recorded_graph(turns: int, store_dir: str):
    """``closedloop react`` through ``run_graph`` with a ``StoreRecorder``: every step of every episode
    is recorded into one run of a real DuckDB store (its background writer commits meanwhile); the
    per-run start/finish transactions are a fixed cost per run, not per step, and are left out."""
    from closedloop.runtime.execute import run_graph
    from closedloop.runtime.recording import StoreRecorder
    from closedloop.store import RunStore

    bound, make_input, client = closedloop_graph(turns)
    store = RunStore(f"{store_dir}/runs.duckdb")

    recorder = StoreRecorder(store, store.start_run(kind="run", graph="react", model_spec=client.spec))

    class Recorded:
        async def ainvoke(self, graph_input):
            return (await run_graph(bound.graph, graph_input, context=bound.context, recorder=recorder)).state

    return Recorded(), make_input, store


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
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-graph-")
    rows = [("raw langgraph", raw_graph(args.turns)), ("closedloop react", closedloop_graph(args.turns)),
            ("closedloop react + recording", recorded_graph(args.turns, tmp)),
            ("raw + ToolNode", toolnode_graph(args.turns, "raw")),
            ("our model node + ToolNode", toolnode_graph(args.turns, "ours")),
            ("LangChain chat model + ToolNode", toolnode_graph(args.turns, "chat"))]

    async def measure() -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        steps = 2 * args.turns - 1
        wall: dict[str, list[float]] = {name: [] for name, _ in rows}
        cpu: dict[str, list[float]] = {name: [] for name, _ in rows}
        for rep in range(args.repeats + 3):  # interleaved: each round runs every graph once
            for name, (graph, make_input, _) in rows:
                t0, c0 = time.perf_counter(), time.process_time()
                out = await graph.ainvoke(make_input())
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if len(out["messages"]) != steps + 1:
                    raise RuntimeError(f"{name}: expected {steps + 1} messages, got {len(out['messages'])}")
                if rep >= 3:  # the first rounds warm up
                    wall[name].append(dt / steps * 1e6)
                    cpu[name].append(dc / steps * 1e6)
        return wall, cpu

    wall, cpu = asyncio.run(measure())
    results = {name: statistics.median(v) for name, v in wall.items()}
    cpu_us = {name: statistics.median(v) for name, v in cpu.items()}
    table = Table(title=f"per-step overhead, {args.turns} model turns, median of {args.repeats} (interleaved); "
                        f"CPU = this process's CPU time (all threads), steadier than wall time on a loaded machine")
    table.add_column("graph")
    table.add_column("wall µs / step", justify="right")
    table.add_column("vs raw", justify="right")
    table.add_column("vs raw + ToolNode", justify="right")
    table.add_column("CPU µs / step", justify="right")
    table.add_column("CPU vs raw", justify="right")
    base, base_tn, base_cpu = results["raw langgraph"], results["raw + ToolNode"], cpu_us["raw langgraph"]
    for name, us in results.items():
        table.add_row(name, f"{us:,.0f}", f"{us / base:.2f}×", f"{us / base_tn:.2f}×", f"{cpu_us[name]:,.0f}",
                      f"{cpu_us[name] / base_cpu:.2f}×")
    Console().print(table)
    ours, chat = results["our model node + ToolNode"], results["LangChain chat model + ToolNode"]
    Console().print(f"LangChain chat-model path vs our model node (same graph): {chat - ours:+,.0f} µs/step "
                    f"({chat / ours:.2f}×)")


if __name__ == "__main__":
    main()
