"""What every τ domain is made of: a typed DB and a toolkit of methods bound to one DB instance.

A toolkit method marked with :func:`is_tool` becomes a :class:`TauTool`, a
:class:`closedloop.tool.Tool` whose errors read exactly like tau2's (``"Error: <message>"``), so
the text an agent sees does not depend on whether it runs here or upstream. ``mutates=True``
marks write tools: the DB grader replays only those.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict

try:  # optional speed-up; present wherever langsmith/langgraph is installed
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None

from closedloop.tool import Tool, ToolRegistry, ToolResult, _ArgError

__all__ = ["TauDB", "TauTool", "Toolkit", "is_tool", "hash_state"]


def hash_state(value: Any) -> str:
    """tau2's DB hash: sha256 of the sorted-key JSON of the dumped model."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


class TauDB(BaseModel):
    """A domain database. Unknown keys are rejected so a wrong file fails loudly at load time."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def load(cls, path: str | Path) -> "TauDB":
        path = Path(path)
        if path.suffix == ".toml":
            import tomllib

            return cls.model_validate(tomllib.loads(path.read_text()))
        return cls.model_validate_json(path.read_bytes())

    def get_hash(self) -> str:
        """sha256 of the DB's sorted-key JSON: equal exactly when tau2's hashes are equal.

        Every graded episode hashes two full databases, so this takes the fast path (orjson,
        compact separators) when orjson is installed; the hex value then differs from tau2's
        string, never the verdict. :func:`hash_state` gives tau2's exact value."""
        if _orjson is not None:
            data = _orjson.loads(self.model_dump_json())
            return hashlib.sha256(_orjson.dumps(data, option=_orjson.OPT_SORT_KEYS)).hexdigest()
        return hash_state(json.loads(self.model_dump_json()))


_TOOL_MARK = "__tau_tool__"


def is_tool(*, mutates: bool = False, kind: str = "read") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a toolkit method as a tool (``kind`` mirrors tau2's READ/WRITE/GENERIC/THINK)."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, _TOOL_MARK, {"mutates": mutates, "kind": kind})
        return fn

    return mark


class TauTool(Tool):
    """A toolkit method as a Tool: validated like any Tool, called inline, errors tau2-shaped.

    Called inline (not in a thread) because tool calls mutate one shared in-memory DB and must
    run strictly in order; the argument models are cached per method since every episode builds
    fresh tools bound to a fresh DB.
    """

    _model_cache: ClassVar[dict[Any, type[BaseModel]]] = {}

    def __init__(self, fn: Callable[..., Any], *, mutates: bool, kind: str) -> None:
        self.kind = kind
        super().__init__(fn, mutates=mutates, timeout_s=None)

    def _build_args_model(self, fn: Callable[..., Any], param_help: dict[str, str]) -> type[BaseModel]:
        key = getattr(fn, "__func__", fn)
        model = self._model_cache.get(key)
        if model is None:
            model = super()._build_args_model(fn, param_help)
            self._model_cache[key] = model
        return model

    def call(self, arguments: str | dict[str, Any] | None) -> ToolResult:
        """Synchronous run; never raises for the caller's or the tool's errors."""
        start = time.perf_counter()
        try:
            kwargs = self.validate(arguments)
        except _ArgError as e:
            return ToolResult(self.name, f"Error: {e.message}", e.message, e.kind, time.perf_counter() - start)
        try:
            value = self.fn(**kwargs)
            content = self._serialize(value)
        except Exception as e:  # the tool's refusal ("Order not found") is the agent's information
            return ToolResult(self.name, f"Error: {e}", str(e), "exception", time.perf_counter() - start)
        return ToolResult(self.name, content, latency_s=time.perf_counter() - start, value=value)

    async def run(self, arguments: str | dict[str, Any] | None) -> ToolResult:
        return self.call(arguments)


class Toolkit:
    """Tools bound to one DB. Subclasses define methods marked with :func:`is_tool`.

    Methods that are not tools (helpers, ``assert_*`` checks used by ENV_ASSERTION) are reached
    by name through :meth:`function`.
    """

    def __init__(self, db: TauDB) -> None:
        self.db = db
        self._tools = ToolRegistry()
        for name in dir(type(self)):
            attr = getattr(type(self), name, None)
            mark = getattr(attr, _TOOL_MARK, None)
            if mark is not None:
                self._tools.register(TauTool(getattr(self, name), mutates=mark["mutates"], kind=mark["kind"]))

    @property
    def tools(self) -> ToolRegistry:
        return self._tools

    def function(self, name: str) -> Callable[..., Any]:
        """A tool or an assertion method by name (ENV_ASSERTION calls these)."""
        if name.startswith("_") or not callable(getattr(self, name, None)):
            raise KeyError(f"{type(self).__name__} has no function {name!r}")
        return getattr(self, name)

    def is_mutating(self, name: str) -> bool:
        return name in self._tools and self._tools.get(name).mutates
