"""The contract of an agent graph, and how callers use one.

A graph (ours or a plugin's, entry point group ``closedloop.graphs``) is **a compiled LangGraph
graph whose context schema is, or extends,** :class:`~closedloop.runtime.context.AgentContext`,
and whose state has ``messages`` (LangChain's form), ``turns`` (the policy's
:class:`~closedloop.messages.Turn`s, the training record) and ``tool_records``
(:class:`~closedloop.runtime.state.AgentState` or a subclass). A graph that reads only some of the
standard settings ignores the others. ``closedloop run``, the τ-bench agents, trainers' rollouts,
the evaluation helpers and ``langgraph dev`` all run graphs this way:

    graph = load_graph("react")
    context = context_for(graph, client=client, tools=tools, approve=["add"])
    out = await with_checkpointer(graph, saver).ainvoke(inputs, config, context=context)

An entry point may name a function instead, of the run config (LangGraph's graph factory, for a
graph whose shape depends on configuration); it must return such a graph.
"""

from __future__ import annotations

from typing import Any, cast

from langgraph.pregel import Pregel

from closedloop.runtime.context import AgentContext

#: A compiled graph of any state and context (the contract is checked at run time, :func:`check_graph`).
Graph = Pregel[Any, Any, Any, Any]


def check_graph(graph: Any, name: str = "") -> Graph:
    """``graph`` itself when it follows the contract; else a ``TypeError`` saying what is wrong."""
    label = name or getattr(graph, "name", None) or repr(graph)
    if not isinstance(graph, Pregel):
        raise TypeError(f"graph {label!r} is not a compiled LangGraph graph (got {type(graph).__name__}); "
                        "export builder.compile() (see closedloop.runtime.contract)")
    schema = graph.context_schema
    if not (isinstance(schema, type) and issubclass(schema, AgentContext)):
        raise TypeError(f"graph {label!r} has context schema {getattr(schema, '__name__', schema)!r}; closedloop "
                        "graphs take closedloop.runtime.context.AgentContext or a subclass of it "
                        "(StateGraph(..., context_schema=AgentContext))")
    return graph


def load_graph(name: str, config: Any = None) -> Graph:
    """The registered graph ``name`` (entry point group ``closedloop.graphs``), checked; a graph
    factory is called with ``config``."""
    from closedloop import plugins

    obj = plugins.load("closedloop.graphs", name)
    if not isinstance(obj, Pregel) and callable(obj):
        obj = obj(config or {})
    return check_graph(obj, name)


def context_for(graph: Graph, **fields: Any) -> AgentContext:
    """The run context of ``graph`` from its fields (its own schema, so its defaults apply to the rest)."""
    schema = cast(type[AgentContext], check_graph(graph).context_schema)  # checked: a subclass of AgentContext
    return schema(**fields)


def with_checkpointer(graph: Graph, checkpointer: Any) -> Graph:
    """``graph`` with ``checkpointer`` (a LangGraph saver, or None), everything else as compiled."""
    return graph.copy({"checkpointer": checkpointer})


__all__ = ["Graph", "check_graph", "load_graph", "context_for", "with_checkpointer"]
