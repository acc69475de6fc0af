"""The graph contract: every registered graph is a compiled LangGraph graph whose context schema
extends AgentContext (and has a JSON schema a server can show); a plugin that is not one is
refused with a clear error; a plain AgentContext given to a graph with its own schema is read with
that graph's defaults for what it did not set."""

import pytest
from langgraph.graph import START, StateGraph
from langgraph.runtime import Runtime

from closedloop import plugins
from closedloop.models.scripted import ScriptedClient
from closedloop.runtime import AgentContext, AgentState, check_graph, context_for, load_graph
from closedloop.runtime.context import DEFAULT_SYSTEM_PROMPT, context_of

GRAPHS = ("react", "clarifier", "factguard", "orchestrator", "kernel", "egg")


def test_every_registered_graph_follows_the_contract():
    assert set(GRAPHS) <= set(plugins.available("closedloop.graphs"))
    for name in GRAPHS:
        graph = load_graph(name)
        assert issubclass(graph.context_schema, AgentContext) and graph.name == name
        schema = graph.get_context_jsonschema()  # what `langgraph dev` shows and filters by
        assert {"model", "tools", "params", "max_turns", "approve"} <= set(schema["properties"])
        assert "client" not in schema["properties"]  # an object, not JSON


def test_a_graph_that_breaks_the_contract_is_refused():
    def factory(client, tools, **options):
        return None

    with pytest.raises(TypeError, match="not a compiled LangGraph graph"):
        check_graph(factory, "old-style")

    builder = StateGraph(AgentState)
    builder.add_node("n", lambda state: {})
    builder.add_edge(START, "n")
    with pytest.raises(TypeError, match="context schema None.*AgentContext or a subclass"):
        check_graph(builder.compile(), "no-context")


def test_a_plain_context_takes_the_graphs_own_defaults():
    from closedloop.agents.factguard import STAGE1_SYSTEM_PROMPT
    from closedloop.graphs.factguard import FactGuardContext

    client = ScriptedClient([])
    read = context_of(Runtime(context=AgentContext(client=client, max_turns=5)), FactGuardContext)
    assert isinstance(read, FactGuardContext) and read.client is client and read.max_turns == 5
    assert read.system_prompt == STAGE1_SYSTEM_PROMPT and read.attach_frames
    none = context_of(Runtime(context=AgentContext(client=client, system_prompt=None)), FactGuardContext)
    assert none.system_prompt is None  # set to none: kept
    assert context_of(Runtime(context=None), AgentContext).system_prompt == DEFAULT_SYSTEM_PROMPT


def test_context_settings_are_checked_when_made():
    graph = load_graph("react")
    with pytest.raises(ValueError, match="max_turns"):
        context_for(graph, max_turns=0)
    with pytest.raises(ValueError, match="unknown_setting"):
        context_for(graph, unknown_setting=1)
    with pytest.raises(KeyError, match="no tool module named 'nosuch'"):
        context_for(graph, tools="arithmetic,nosuch")
    assert sorted(t.name for t in context_for(graph, tools=["arithmetic"]).tools) >= ["add", "multiply"]
