"""The catalog ``closedloop tools`` lists built-in tools from must say what the real tools say."""

from __future__ import annotations

from closedloop import plugins
from closedloop.cli.tools import tool_rows
from closedloop.tools.catalog import CATALOG, ToolSummary, render


def test_catalog_matches_the_real_tools():
    tools = plugins.registry("tools")
    ours = {p.target: name for name, p in tools.plugins().items() if (p.distribution or "").startswith("closedloop ")}
    real = {target: tuple(ToolSummary(t.name, t.mutates, t.description.splitlines()[0]) for t in tools.load(name))
            for target, name in sorted(ours.items())}
    assert CATALOG == real, "tools/catalog.py is out of date; its CATALOG entries should read:\n" + render(real)


def test_listing_from_the_catalog_equals_listing_from_the_tools():
    registry = plugins.tool_registry(["arithmetic", "mesh_certificate"])
    expected = [(module, t.name, t.mutates, t.description.splitlines()[0])
                for module in ("arithmetic", "mesh_certificate")
                for t in plugins.load("closedloop.tools", module)]
    assert tool_rows(["arithmetic", "mesh_certificate"]) == expected
    assert [row[1] for row in expected] == [t.name for t in registry]
