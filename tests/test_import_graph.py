"""The library's imports flow one way and form no cycle (``scripts/import_graph.py`` reads them with ``ast``,
imports inside functions included).

Today's known exceptions are listed below, each an import edge (importer, imported). The lists may
only shrink: an edge that no longer exists, or no longer closes a cycle, fails the test until it is
deleted here, and a new cycle or layer violation fails it at once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Cycles being untangled by their owners (issue 27, point 7); one edge per cycle, the one that goes
# against the intended order, so removing the listed edges leaves no cycle.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()

# Imports against the layers (core ← tools, memory ← agents ← graphs ← evals ← trainers; ui ← cli on top).
KNOWN_LAYER_EDGES: set[tuple[str, str]] = set()


def _load_script():
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


graph = _load_script()


@pytest.fixture(scope="module")
def edges():
    return graph.import_edges()


def _pairs(edges) -> set[tuple[str, str]]:
    return {(e.source, e.target) for e in edges}


def test_the_graph_sees_imports_inside_functions_and_the_linked_folders(edges):
    """The reader itself: a deferred import and a module of a linked-in folder both appear (a
    reader that missed them would pass every check below vacuously)."""
    pairs = _pairs(edges)
    assert ("closedloop.store.store", "closedloop.store.connection") in pairs
    assert any(e.deferred for e in edges)
    assert any(e.source.startswith("closedloop.trainers.") for e in edges)
    assert graph.cycles([graph.Edge("a", "b", 1, False), graph.Edge("b", "c", 1, True),
                         graph.Edge("c", "a", 1, False), graph.Edge("c", "d", 1, False)]) == [["a", "b", "c"]]


def test_no_import_cycles_beyond_the_known_ones(edges):
    remaining = [e for e in edges if (e.source, e.target) not in KNOWN_CYCLE_EDGES]
    found = graph.cycles(remaining)
    detail = "\n".join(f"{' '.join(c)}:\n  " + "\n  ".join(str(e) for e in remaining
                                                          if e.source in c and e.target in c) for c in found)
    assert not found, f"import cycles:\n{detail}"


def test_known_cycle_edges_are_still_needed(edges):
    pairs = _pairs(edges)
    components = graph.cycles(edges)
    stale = sorted(edge for edge in KNOWN_CYCLE_EDGES
                   if edge not in pairs or not any(edge[0] in c and edge[1] in c for c in components))
    assert not stale, f"no longer closes a cycle, delete from KNOWN_CYCLE_EDGES: {stale}"


def test_imports_follow_the_layers(edges):
    bad = [e for e in graph.layer_violations(edges) if (e.source, e.target) not in KNOWN_LAYER_EDGES]
    assert not bad, "imports against the layers:\n" + "\n".join(map(str, bad))
    stale = sorted(KNOWN_LAYER_EDGES - _pairs(graph.layer_violations(edges)))
    assert not stale, f"gone, delete from KNOWN_LAYER_EDGES: {stale}"


def test_redaction_is_imported_from_its_leaf_module(edges):
    """Redaction is one leaf module any layer may import (importing it through the store package
    would run all of the store, DuckDB included)."""
    importers = {e.source for e in edges if e.target.startswith("closedloop.store") and e.target.endswith("redact")}
    assert not importers, f"import closedloop.redact instead: {importers}"
    redact_imports = {e.target for e in edges if e.source == "closedloop.redact"}
    assert not redact_imports, f"closedloop.redact must stay a leaf, it imports {redact_imports}"
