"""One registry for every named thing that lives outside the core, so the core never imports a
graph, tool module, benchmark or trainer by name.

Each kind is a group of Python entry points. closedloop declares its own plugins in its
``pyproject.toml`` exactly as a user's package declares theirs::

    [project.entry-points."closedloop.graphs"]
    my_agent = "my_pkg.graph:build"

Discovery reads the installed distributions' metadata and imports nothing, so listing
(``closedloop plugins``, ``closedloop tools``, ``closedloop --help``) stays cheap; a plugin's module
is imported when it is loaded. A name that two distributions declare in one group is an error that
names both (which one loads would otherwise be an accident of ``sys.path`` order). Code may also
register a plugin in-process (:meth:`Registry.register`), e.g. a τ domain defined in a notebook;
the same duplicate rule applies unless it asks to replace.

A plugin's one-line description is the first paragraph of its module's docstring, read from the
source without importing the module (as ``pydoc`` summarises modules).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import threading
import tokenize
import types
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from closedloop.tool import ToolRegistry

__all__ = ["Kind", "KINDS", "Plugin", "Registry", "PluginNotFound", "DuplicatePluginError", "registry", "available",
           "load", "tool_registry"]


@dataclass(frozen=True)
class Kind:
    """A kind of plugin: its entry-point group and what an entry point of it must name."""

    name: str
    group: str
    noun: str  # one plugin of the kind, in messages ("no τ domain named 'x'")
    contract: str


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("graphs", "closedloop.graphs", "graph", "an agent graph: a compiled LangGraph graph or a function building one"),
    Kind("tools", "closedloop.tools", "tool module", "a list of closedloop.tool.Tool"),
    Kind("domains", "closedloop.domains", "τ domain",
         "a τ-bench Domain (closedloop.evals.tau.domains), or a function of no arguments returning one"),
    Kind("environments", "closedloop.environments", "environment",
         "a factory called with the options as keywords, returning a closedloop.env.AgentEnvironment"),
    Kind("benchmarks", "closedloop.benchmarks", "benchmark",
         "register(subparsers): adds a `closedloop eval` subcommand; its module imports only what building "
         "the parser needs"),
    Kind("trainers", "closedloop.trainers", "trainer",
         "a module with CONFIG_CLASS (a pydantic config) and run_from_config(config), run by `closedloop train`"),
    Kind("recipes", "closedloop.recipes", "recipe",
         "a recipe YAML file's path, or a Recipe: a multi-stage pipeline run by `closedloop recipe`"),
    Kind("backends", "closedloop.backends", "model backend",
         "a factory (ModelSpec, **options) -> ModelClient for model specs '<name>:<model>'"),
    Kind("commands", "closedloop.commands", "command",
         "register(subparsers): adds a `closedloop` subcommand; its module imports only what building the "
         "parser needs"),
)}
_BY_GROUP = {k.group: k for k in KINDS.values()}


class PluginNotFound(KeyError):
    """No plugin of that name in a group; the message lists the ones there are."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


class DuplicatePluginError(ValueError):
    """Two sources give one name in one group."""


@dataclass(frozen=True)
class Plugin:
    """One named plugin and where it comes from, known without importing it."""

    kind: str
    name: str
    target: str  # "module:attr", or "module" when the module itself is the plugin
    distribution: str | None  # "closedloop 0.1.0"; None when registered in-process
    entry_point: EntryPoint | None = field(default=None, compare=False, repr=False)

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def source(self) -> str:
        return self.distribution or "registered in-process"


@functools.cache
def _entry_points() -> Any:
    """Every installed entry point, read once per process (one pass over the distributions;
    ``.select(group=...)`` filters it, on Python 3.11 and later alike)."""
    from importlib.metadata import entry_points

    return entry_points()


def _distribution(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"


class Registry:
    """The plugins of one kind: the entry points of its group plus in-process registrations."""

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self._lock = threading.RLock()
        self._declared: dict[str, Plugin] | None = None
        self._local: dict[str, Plugin] = {}
        self._loaded: dict[str, Any] = {}

    def _entry_plugins(self) -> dict[str, Plugin]:
        with self._lock:
            if self._declared is None:
                declared: dict[str, Plugin] = {}
                for ep in _entry_points().select(group=self.kind.group):
                    plugin = Plugin(self.kind.name, ep.name, ep.value, _distribution(ep), ep)
                    other = declared.get(ep.name)
                    if other is not None and other.target != plugin.target:
                        raise DuplicatePluginError(
                            f"two distributions declare the {self.kind.noun} {ep.name!r} (entry point group "
                            f"{self.kind.group}): {other.source} ({other.target}) and {plugin.source} "
                            f"({plugin.target}); uninstall one of them or rename the entry point")
                    declared[ep.name] = plugin
                self._declared = declared
            return self._declared

    def plugins(self) -> dict[str, Plugin]:
        """Every plugin of the kind by name, sorted; in-process registrations shadow entry points
        only when registered with ``replace=True``. Imports nothing."""
        with self._lock:
            merged = {**self._entry_plugins(), **self._local}
        return dict(sorted(merged.items()))

    def names(self) -> list[str]:
        return list(self.plugins())

    def get(self, name: str) -> Plugin:
        found = self.plugins()
        if name not in found:
            raise PluginNotFound(f"no {self.kind.noun} named {name!r}; available: {sorted(found)}"
                                 + ("" if found else f" ({self.missing_hint()})"))
        return found[name]

    def missing_hint(self) -> str:
        """What to say when a kind has no plugin at all: closedloop's own come from its installed
        metadata, which an install made before their entry points were declared lacks."""
        return (f"no {self.kind.group} entry point is installed; if closedloop's own are missing, its "
                f"metadata is stale: reinstall it (python -m pip install -e .)")

    def load(self, name: str) -> Any:
        """What the plugin names (imported on first use; the same object after)."""
        plugin = self.get(name)
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
        assert plugin.entry_point is not None  # in-process plugins are always in _loaded
        obj = plugin.entry_point.load()
        with self._lock:
            return self._loaded.setdefault(name, obj)

    def register(self, name: str, obj: Any, *, replace: bool = False) -> Any:
        """Add a plugin from code. Registering the object a name already gives is a no-op; another
        object under a taken name is a :class:`DuplicatePluginError` unless ``replace``."""
        with self._lock:
            current = self.plugins().get(name)
            if current is not None and not replace and self._peek(current) is not obj:
                raise DuplicatePluginError(f"a {self.kind.noun} named {name!r} is already registered "
                                           f"({current.source}: {current.target}); pass replace=True to replace it")
            self._local[name] = Plugin(self.kind.name, name, _target_of(obj), None)
            self._loaded[name] = obj
        return obj

    def _peek(self, plugin: Plugin) -> Any:
        """The plugin's object if it is loaded (or its module already imported), without importing."""
        if plugin.name in self._loaded:
            return self._loaded[plugin.name]
        module, _, attr = plugin.target.partition(":")
        obj: Any = sys.modules.get(module)
        for part in attr.split(".") if attr and obj is not None else ():
            obj = getattr(obj, part, None)
        return obj

    def describe(self, name: str) -> str:
        """The plugin's one-line description, read from the source file without importing it: the
        ``#:`` comment above the attribute the entry point names (its own, as for the recipes
        ``demo`` and ``latency``, two constants of one module), else the first paragraph of its
        module's docstring ("" when there is neither)."""
        plugin = self.get(name)
        if plugin.distribution is None:
            obj = self._loaded.get(name)
            described = isinstance(obj, (type, types.FunctionType, types.ModuleType))
            return _first_paragraph(obj.__doc__ if described else None)
        attr = plugin.target.partition(":")[2]
        return (attribute_comment(plugin.module, attr) if attr else "") or module_summary(plugin.module)


def _target_of(obj: Any) -> str:
    """How an in-process plugin is shown: ``module:qualname`` for a function or class, the module
    name for a module, else the object's type."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, (type, types.FunctionType)):
        return f"{obj.__module__}:{obj.__qualname__}"
    return f"{type(obj).__module__}:{type(obj).__qualname__}(...)"


_REGISTRIES: dict[str, Registry] = {}
_REGISTRIES_LOCK = threading.Lock()


def registry(kind: str) -> Registry:
    """The registry of a kind, by name (``"graphs"``) or entry-point group (``"closedloop.graphs"``)."""
    spec = KINDS.get(kind) or _BY_GROUP.get(kind)
    if spec is None:
        raise PluginNotFound(f"no plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
    with _REGISTRIES_LOCK:
        return _REGISTRIES.setdefault(spec.name, Registry(spec))


def available(group: str) -> dict[str, Plugin]:
    """The plugins of a group by name, not loaded."""
    return registry(group).plugins()


def load(group: str, name: str) -> Any:
    """Load one plugin of a group; :class:`PluginNotFound` names the available ones."""
    return registry(group).load(name)


def tool_registry(modules: list[str] | None = None) -> ToolRegistry:
    """A :class:`~closedloop.tool.ToolRegistry` holding the tools of the named tool modules
    (``closedloop.tools`` plugins; all of them when ``modules`` is None)."""
    from closedloop.tool import ToolRegistry

    tools = registry("tools")
    result = ToolRegistry()
    for name in modules if modules is not None else tools.names():
        result.extend(list(tools.load(name)))
    return result


def module_summary(module: str) -> str:
    """The first paragraph of a module's docstring as one line, read without importing the module
    or its parent packages (``importlib.util.find_spec`` would import the parents; τ's package
    imports its whole evaluator)."""
    path = _source_file(module)
    if path is None:
        return ""
    try:
        with tokenize.open(path) as f:
            doc = _first_string(tokenize.generate_tokens(f.readline))
    except (OSError, SyntaxError, tokenize.TokenError, ValueError):
        return ""
    return _first_paragraph(doc)


def attribute_comment(module: str, attr: str) -> str:
    """The ``#:`` comment lines right above a module-level assignment to ``attr`` (Sphinx's
    attribute doc comment), as one line of plain text; "" when there are none. Read from the
    source, without importing the module."""
    path = _source_file(module)
    if path is None:
        return ""
    try:
        with tokenize.open(path) as f:
            lines = f.read().splitlines()
    except (OSError, SyntaxError, ValueError):
        return ""
    assignment = re.compile(rf"^{re.escape(attr)}\s*(:[^=]*)?=")
    for i, line in enumerate(lines):
        if assignment.match(line):
            comment: list[str] = []
            for above in reversed(lines[:i]):
                if not above.startswith("#:"):
                    break
                comment.insert(0, above[2:].strip())
            return plain_text(" ".join(comment))
    return ""


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :mod:`closedloop.ui` -> closedloop.ui


def plain_text(text: str) -> str:
    """``text`` with reST literals and roles unwrapped (``x`` and :mod:`x` become x): what terminals
    show of a docstring, where the markup is noise."""
    return _ROLE.sub(r"\1", text).replace("``", "")


def _first_paragraph(doc: str | None) -> str:
    """The docstring's first paragraph as one line of plain text."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return plain_text(" ".join(line.strip() for line in paragraph.splitlines()))


def _first_string(tokens: Iterable[tokenize.TokenInfo]) -> str | None:
    skip = {tokenize.ENCODING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE}
    for tok in tokens:
        if tok.type in skip:
            continue
        if tok.type == tokenize.STRING:
            value = ast.literal_eval(tok.string)
            return value if isinstance(value, str) else None
        return None
    return None


def _source_file(module: str) -> str | None:
    loaded = sys.modules.get(module)
    if loaded is not None:
        return getattr(loaded, "__file__", None)
    parts = module.split(".")
    spec: ModuleSpec | None = None
    path: list[str] | None = None  # where the next part is looked for (None: the top level)
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        imported = sys.modules.get(name)
        spec = imported.__spec__ if imported is not None else _find_spec(name, path)
        if spec is None:
            return None
        search = getattr(imported, "__path__", None) if imported is not None else spec.submodule_search_locations
        path = list(search or [])
    return spec.origin if spec is not None and spec.has_location else None


def _find_spec(name: str, path: list[str] | None) -> ModuleSpec | None:
    """Ask the import system's finders, as ``import`` does, without executing anything."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, path)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            return spec
    return None
