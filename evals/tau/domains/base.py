"""What every τ domain is made of: a typed DB and a toolkit of methods bound to one DB instance.

Tools behave as tau2's (``src/tau2/environment/{tool,toolkit,environment}.py``) so that what an
agent sees does not depend on whether it runs here or upstream:

- the schema is built the way tau2 builds it: the Google docstring (``docstring_parser``) gives
  the description (short + "\\n\\n" + long) and the parameter descriptions, and pydantic's
  ``create_model("parameters", ...)`` gives the JSON schema, titles included;
- a call passes the model's arguments to the method as they are (no validation or coercion:
  a wrong type reaches the tool, a missing or extra argument is Python's ``TypeError``), and any
  exception becomes ``"Error: <exception text>"``;
- results are serialised as tau2's ``Environment.to_json_str`` does (``json.dumps`` of
  ``model_dump()``; strings pass through; numbers and bools as ``str``);
- tools are listed in definition order (the order of the class body, bases first).

``mutates=True`` marks write tools: the DB grader replays only those.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
import types
import typing
from datetime import date, datetime
from enum import Enum
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, Field, create_model

_orjson: types.ModuleType | None
try:  # optional speed-up; present wherever langsmith/langgraph is installed
    import orjson as _orjson
except ImportError:  # pragma: no cover
    _orjson = None

from closedloop.tool import Tool, ToolRegistry, ToolResult

__all__ = ["TauDB", "TauTool", "Toolkit", "ToolType", "is_tool", "hash_state", "to_json_str", "tau2_description"]


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
        string, never the verdict. :meth:`tau2_hash` gives tau2's exact value."""
        if _orjson is not None:
            return hashlib.sha256(_orjson.dumps(self.model_dump(), option=_orjson.OPT_SORT_KEYS | _orjson.OPT_NON_STR_KEYS)).hexdigest()
        return self.tau2_hash()

    def tau2_hash(self) -> str:
        """tau2's exact hex value (``get_dict_hash(db.model_dump())``)."""
        return hash_state(self.model_dump())


def to_json_str(value: Any) -> str:
    """tau2 ``Environment.to_json_str``: how a tool's return value becomes the tool message."""

    def process(resp: Any) -> Any:
        if isinstance(resp, BaseModel):
            return resp.model_dump()
        if isinstance(resp, str) or resp is None:
            return resp
        if isinstance(resp, (int, float, bool)):
            return str(resp)
        if isinstance(resp, list):
            return [process(x) for x in resp]
        if isinstance(resp, tuple):
            return tuple(process(x) for x in resp)
        if isinstance(resp, dict):
            return {k: process(v) for k, v in resp.items()}
        if isinstance(resp, (datetime, date)):
            return resp.isoformat()
        raise ValueError(f"Unsupported type: {type(resp)}")

    if isinstance(value, str):
        return value
    return json.dumps(process(value), default=str)


_TOOL_MARK = "__tau_tool__"
# tau2 calls a tool as ``Environment.make_tool_call(self, tool_name, requestor, **kwargs)``: these
# names are the dispatcher's own and can never reach a tool.
DISPATCHER_PARAMETERS = ("self", "tool_name", "requestor")


class ToolType(str, Enum):
    """tau2's tool classification (so ported toolkits keep ``@is_tool(ToolType.WRITE)``)."""

    READ = "read"
    WRITE = "write"
    THINK = "think"
    GENERIC = "generic"


def is_tool(tool_type: ToolType | str | None = None, mutates_state: bool | None = None, *,
            mutates: bool | None = None, kind: str = "read") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a toolkit method as a tool: ``@is_tool(kind="write")`` or tau2's
    ``@is_tool(ToolType.WRITE, mutates_state=...)``. Mutation defaults as tau2's
    ``mutates_state``: True exactly for write tools."""
    kind = ToolType(tool_type).value if tool_type is not None else kind
    mutates = mutates_state if mutates_state is not None else mutates

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, _TOOL_MARK, {"mutates": kind == "write" if mutates is None else mutates, "kind": kind})
        return fn

    return mark


def tau2_description(doc: str | None) -> tuple[str, dict[str, str | None]]:
    """(description, parameter descriptions) exactly as tau2's ``Tool.parse_data`` reads them."""
    from docstring_parser import parse

    parsed = parse(doc or "")
    short, long = parsed.short_description or "", parsed.long_description or ""
    description = short if not long else short + "\n\n" + long
    return description, {p.arg_name: p.description for p in parsed.params}


class TauTool(Tool):
    """A toolkit method as a Tool with tau2's schema, calling convention and error strings.

    Called inline (not in a thread) because tool calls mutate one shared in-memory DB and must
    run strictly in order. The schema is cached per (method, docstring): every episode builds
    fresh tools bound to a fresh DB.
    """

    _schema_cache: ClassVar[dict[Any, tuple[str, type[BaseModel]]]] = {}
    _parameters_cache: ClassVar[dict[type[BaseModel], str]] = {}  # JSON schema text per arguments model

    def __init__(self, fn: Callable[..., Any], *, mutates: bool, kind: str, doc: str | None = None) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.kind = kind
        self.mutates = mutates
        self.timeout_s = None
        self.is_async = False
        key = (getattr(fn, "__func__", fn), doc)
        cached = self._schema_cache.get(key)
        if cached is None:
            cached = self._build(fn, doc if doc is not None else fn.__doc__)
            self._schema_cache[key] = cached
        self.description, self.args_model = cached
        reserved = sorted(set(self.args_model.model_fields) & set(DISPATCHER_PARAMETERS))
        if reserved:  # tau2's dispatcher would take them for its own (see environment.dispatcher_conflict)
            raise ValueError(f"tool {self.name!r} has a parameter named {reserved[0]!r}, which tau2's "
                             f"make_tool_call(tool_name, requestor, **kwargs) reserves: no call could reach "
                             f"the tool; rename it")

    @staticmethod
    def _build(fn: Callable[..., Any], doc: str | None) -> tuple[str, type[BaseModel]]:
        description, param_help = tau2_description(doc)
        if not description:
            description = fn.__name__
        params: dict[str, Any] = {}
        try:  # string annotations (``from __future__ import annotations``) resolved to types
            hints = typing.get_type_hints(fn)
        except Exception:
            hints = {}
        for name, p in inspect.signature(fn).parameters.items():
            anno = hints.get(name, Any if p.annotation is p.empty else p.annotation)
            default = ... if p.default is p.empty else p.default
            if name in param_help:
                default = Field(default, description=param_help[name])
            params[name] = (anno, default)
        return description, create_model("parameters", **params)

    @property
    def parameters(self) -> dict[str, Any]:
        """The arguments' JSON schema. pydantic builds it in about a millisecond and an agent
        asks for every tool's on every episode, so the text is kept per arguments model (each
        caller gets its own dict)."""
        text = self._parameters_cache.get(self.args_model)
        if text is None:
            text = json.dumps(self.args_model.model_json_schema())
            self._parameters_cache[self.args_model] = text
        return json.loads(text)

    @property
    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def validate(self, arguments: str | dict[str, Any] | None) -> dict[str, Any]:
        """Check arguments against the schema (not used when calling: tau2 calls with raw kwargs)."""
        if isinstance(arguments, str):
            arguments = json.loads(arguments or "{}")
        parsed = self.args_model.model_validate(arguments or {})
        return {k: getattr(parsed, k) for k in type(parsed).model_fields}

    def call(self, arguments: str | dict[str, Any] | None) -> ToolResult:
        """tau2 ``Environment.get_response``: raw kwargs in, ``Error: …`` on any exception."""
        start = time.perf_counter()
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                # tau2's client parser raises here and the turn fails; we tell the model instead.
                msg = f"arguments are not valid JSON ({e.msg} at position {e.pos})"
                return ToolResult(self.name, f"Error: {msg}", msg, "malformed_json", time.perf_counter() - start)
        if not isinstance(arguments, dict):
            msg = f"arguments must be a JSON object, got {type(arguments).__name__}"
            return ToolResult(self.name, f"Error: {msg}", msg, "invalid_arguments", time.perf_counter() - start)
        try:
            value = self.fn(**arguments)
            content = to_json_str(value)
        except Exception as e:  # the tool's refusal ("Order not found") is the agent's information
            return ToolResult(self.name, f"Error: {e}", str(e), "exception", time.perf_counter() - start)
        return ToolResult(self.name, content, latency_s=time.perf_counter() - start, value=value)

    async def run(self, arguments: str | dict[str, Any] | None) -> ToolResult:
        return self.call(arguments)


class Toolkit:
    """Tools bound to one DB. Subclasses define methods marked with :func:`is_tool`.

    Methods that are not tools (helpers, ``assert_*`` checks used by ENV_ASSERTION) are reached
    by name through :meth:`function`. ``descriptions`` replaces docstrings by tool name (read
    from a tau2 checkout, see :mod:`.tau2_source`); ``options`` are the domain's documented
    deviations from tau2, all off by default.
    """

    def __init__(self, db: TauDB, *, descriptions: dict[str, str] | None = None, **options: Any) -> None:
        self.db = db
        self.options = options
        self._descriptions = descriptions or {}
        self._tools = ToolRegistry()
        for name in self.tool_names():
            mark = getattr(getattr(type(self), name), _TOOL_MARK)
            self._tools.register(TauTool(getattr(self, name), mutates=mark["mutates"], kind=mark["kind"],
                                         doc=self._descriptions.get(name)))

    @classmethod
    def tool_names(cls) -> list[str]:
        """Tool methods in definition order (bases first), as tau2's toolkit metaclass lists them."""
        names: list[str] = []
        for klass in reversed(cls.__mro__):
            for name, attr in vars(klass).items():
                if getattr(attr, _TOOL_MARK, None) is not None and name not in names:
                    names.append(name)
        return [n for n in names if getattr(getattr(cls, n, None), _TOOL_MARK, None) is not None]

    @classmethod
    def tool_marks(cls) -> dict[str, dict[str, Any]]:
        """{tool name: {"mutates", "kind"}} without building a toolkit (no DB needed)."""
        return {n: dict(getattr(getattr(cls, n), _TOOL_MARK)) for n in cls.tool_names()}

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

    def tool_type(self, name: str) -> str | None:
        return self._tools.get(name).kind if name in self._tools else None  # type: ignore[attr-defined]
