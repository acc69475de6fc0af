"""The graph-factory contract: our graphs satisfy it, a malformed plugin is refused with a clear
error, and the served factory reads the model and tools from the run's config."""

import pytest

from closedloop import plugins
from closedloop.messages import UserMessage
from closedloop.runtime.factory import GraphFactory, MissingModel, check_factory, served_graph


def test_registered_graphs_follow_the_contract():
    for name in ("react", "clarifier"):
        factory = plugins.load("closedloop.graphs", name)
        check_factory(factory, name)
        assert isinstance(factory, GraphFactory)


def test_a_factory_missing_options_is_refused():
    def bad(client, tools, *, system_prompt=None):
        return None

    with pytest.raises(TypeError, match="missing: params, max_turns"):
        check_factory(bad, "bad")


async def test_served_graph_without_model_says_what_to_set():
    from closedloop.graphs.react import build_react_graph, make_graph

    graph = make_graph({"configurable": {"tools": ""}})
    with pytest.raises(ValueError, match="set configurable.model"):
        await graph.ainvoke({"messages": [UserMessage(content="hi")]})
    seen = {}

    def factory(client, tools=None, **kw):
        seen.update(client=client, tools=sorted(t.name for t in tools), **kw)
        return build_react_graph(client, tools, **kw)

    served_graph(factory, {"configurable": {"tools": "arithmetic", "max_turns": "3"}, "context": {"approve": ["add"]}})
    assert isinstance(seen["client"], MissingModel) and "add" in seen["tools"]
    assert seen["max_turns"] == 3 and seen["approve"] == ["add"]
