"""The library's import graph, read from source with ``ast``: its cycles and its imports against the layers.

Every ``import`` and ``from ... import`` counts, at module level, inside functions and under
``if TYPE_CHECKING:`` alike (a function-level import hides a cycle from the interpreter, not from a
reader), and so does ``importlib.import_module("closedloop....")`` with a literal name. An edge
goes to the most specific library module named (``from closedloop.store import schema``: to
``closedloop.store.schema``; ``from closedloop.store import RunStore``: to ``closedloop.store``)
and to each package on the way whose ``__init__`` that import runs: ``closedloop.ui``
importing ``closedloop.store.reads`` runs ``closedloop/store/__init__.py`` and all it imports.
A module's own enclosing packages are no edge (a package importing its submodules, and they
their siblings, is how packages work).

The layers (``ARCHITECTURE.md``): core (``closedloop/``) ← ``tools/``, ``memory/`` ← ``agents/`` ←
``graphs/`` ← ``evals/`` ← ``trainers/``; ``closedloop/cli``, ``closedloop/ui`` and
``closedloop/__main__`` on top (in that order: ``closedloop ui`` starts the viewer). A module may
import its own layer and the ones below it.

    python scripts/import_graph.py          # cycles and layer violations, one line each; exit 1 if any

``tests/test_import_graph.py`` runs the same checks with today's known exceptions listed.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "closedloop"

# Rank of each layer; a module may import modules of its own rank or lower. The top-level folders
# are siblings at their rank (tools and memory never import each other).
LAYERS: dict[str, int] = {"tools": 1, "memory": 1, "agents": 2, "graphs": 3, "evals": 4, "trainers": 5,
                          "ui": 6, "cli": 7, "__main__": 8}


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line`` (``deferred``: inside a function or TYPE_CHECKING)."""

    source: str
    target: str
    line: int
    deferred: bool

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line}{', deferred' if self.deferred else ''})"


def library_modules(root: Path = REPO / PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name, the linked-in folders included."""
    modules: dict[str, Path] = {}
    for directory, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        rel = Path(directory).relative_to(root)
        prefix = ".".join((PACKAGE, *rel.parts))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            stem = name[:-3]
            modules[prefix if stem == "__init__" else f"{prefix}.{stem}"] = Path(directory) / name
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a library module (None outside the library)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """A relative ``from`` import's base as an absolute name."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: dict[str, Path]) -> None:
        self.module, self.is_package, self.modules = module, is_package, modules
        self.edges: list[Edge] = []
        self._depth = 0  # inside a function or an ``if TYPE_CHECKING:`` block

    def _add(self, name: str, line: int) -> None:
        target = _resolve(name, self.modules)
        if target is None:
            return
        # The packages on the way run their __init__ too, unless they are the importer's own.
        parts = target.split(".")
        for depth in range(2, len(parts) + 1):
            module = ".".join(parts[:depth])
            if module != self.module and not (self.module + ".").startswith(module + ".") and (
                    module == target or module in self.modules):
                self.edges.append(Edge(self.module, module, line, self._depth > 0))

    def _deferred(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _deferred

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            self._deferred(node)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _absolute(self.module, self.is_package, node.level, node.module)
        for alias in node.names:
            self._add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in self.modules else base, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(node.args[0].value, node.lineno)
        self.generic_visit(node)


def import_edges(modules: dict[str, Path] | None = None) -> list[Edge]:
    """Every import edge between library modules."""
    modules = modules if modules is not None else library_modules()
    edges: list[Edge] = []
    for name, path in modules.items():
        collector = _Collector(name, path.name == "__init__.py", modules)
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        edges += dict.fromkeys(collector.edges)  # once per line, however many names it imports
    return edges


def layer(module: str) -> tuple[int, str]:
    """(rank, folder) of a module: ``closedloop.evals.tau.runner`` -> (4, "evals"); the core is (0, "")."""
    parts = module.split(".")
    folder = parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""
    return LAYERS.get(folder, 0), folder


def layer_violations(edges: list[Edge]) -> list[Edge]:
    """Edges to a higher layer, or to a sibling folder of the same rank."""
    bad = []
    for e in edges:
        (src_rank, src_folder), (dst_rank, dst_folder) = layer(e.source), layer(e.target)
        if dst_rank > src_rank or (dst_rank == src_rank and dst_folder != src_folder):
            bad.append(e)
    return bad


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative),
    each sorted, largest first: every import cycle lies within one of them."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


def main() -> int:
    edges = import_edges()
    problems = 0
    for component in cycles(edges):
        members = set(component)
        problems += 1
        print(f"cycle among {len(component)} modules:")
        for e in sorted(edges, key=str):
            if e.source in members and e.target in members:
                print(f"    {e}")
    for e in layer_violations(edges):
        problems += 1
        print(f"against the layers: {e}")
    print(f"{len(edges)} import edges; {problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
