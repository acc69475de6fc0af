"""Typed tools: a Python function's signature and docstring are its schema.

``@tool`` turns a typed function (sync or async) into a :class:`Tool`. The same object serves the
OpenAI tools protocol (``tool.schema``), chat templates of local models (they take the same JSON
schema) and our LangGraph tool node (``await tool.run(arguments)``).

Errors are split by who can fix them, but all of them come back to the model as a tool message
and the run continues: malformed JSON and bad arguments (the model's fault) say what was wrong
and show the schema; exceptions and timeouts (the tool's fault) say so plainly.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from closedloop.messages import ToolCall, ToolMessage

__all__ = ["Tool", "ToolResult", "ToolRegistry", "tool", "ToolDefinitionError", "DEFAULT_REGISTRY"]


class ToolDefinitionError(TypeError):
    """A function cannot become a tool (untyped parameter, duplicate name, ...)."""


@dataclass
class ToolResult:
    """What one tool call returned: content for the model, or an error that replaces it."""

    name: str
    content: str
    error: str | None = None
    error_kind: str | None = None  # "malformed_json" | "invalid_arguments" | "unknown_tool" | "exception" | "timeout"
    latency_s: float = 0.0
    value: Any = None  # the Python return value, for callers that want it unserialised

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_message(self, call_id: str) -> ToolMessage:
        return ToolMessage(tool_call_id=call_id, name=self.name, content=self.content, error=self.error)


_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {param: help})."""
    doc = inspect.cleandoc(doc or "")
    lines = doc.splitlines()
    desc_lines: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        header = stripped.rstrip(":").lower()
        if stripped.endswith(":") and header in {"args", "arguments", "parameters", "returns", "raises", "yields", "example", "examples", "note"}:
            section = header
            current = None
            continue
        if section is None:
            desc_lines.append(line)
        elif section in {"args", "arguments", "parameters"}:
            m = _ARG_LINE.match(line)
            if m and (len(line) - len(line.lstrip())) <= 4:
                current = m.group(1).lstrip("*")
                params[current] = m.group(3).strip()
            elif current and stripped:
                params[current] += " " + stripped
    description = "\n".join(desc_lines).strip()
    return description, params


class Tool:
    """A callable tool with a JSON schema, argument validation, timeouts and error capture."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                 timeout_s: float | None = 60.0, mutates: bool = False,
                 serialize: Callable[[Any], str] | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        if not re.fullmatch(r"[A-Za-z0-9_\-]{1,64}", self.name):
            raise ToolDefinitionError(f"tool name {self.name!r} must match [A-Za-z0-9_-]{{1,64}} (OpenAI's rule)")
        doc_desc, param_help = _parse_docstring(fn.__doc__ or "")
        self.description = description or doc_desc or self.name
        self.timeout_s = timeout_s
        self.mutates = mutates
        self.is_async = inspect.iscoroutinefunction(fn)
        self._serialize = serialize or default_serialize
        self.args_model = self._build_args_model(fn, param_help)

    def _build_args_model(self, fn: Callable[..., Any], param_help: dict[str, str]) -> type[BaseModel]:
        sig = inspect.signature(fn)
        hints = get_type_hints(fn, include_extras=True)
        fields: dict[str, Any] = {}
        for pname, p in sig.parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ToolDefinitionError(f"tool {self.name}: *args/**kwargs cannot be described by a schema")
            if pname not in hints:
                raise ToolDefinitionError(f"tool {self.name}: parameter {pname!r} needs a type annotation")
            from pydantic import Field as _Field

            default = ... if p.default is inspect.Parameter.empty else p.default
            fields[pname] = (hints[pname], _Field(default, description=param_help.get(pname)))
        model = create_model(f"{self.name}_args", __config__=ConfigDict(extra="forbid"), **fields)
        return model

    # ------------------------------------------------------------------ schema

    @property
    def parameters(self) -> dict[str, Any]:
        schema = self.args_model.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        schema.setdefault("properties", {})
        return schema

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry; chat templates of local models take the same dict."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    # ------------------------------------------------------------------ calling

    def validate(self, arguments: str | dict[str, Any] | None) -> dict[str, Any]:
        """Parse and validate arguments; raises ValueError with a message written for the model."""
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise _ArgError("malformed_json", f"arguments are not valid JSON ({e.msg} at position {e.pos}); "
                                f"send a JSON object matching the schema: {json.dumps(self.parameters)}") from None
        if not isinstance(arguments, dict):
            raise _ArgError("invalid_arguments", f"arguments must be a JSON object, got {type(arguments).__name__}")
        try:
            parsed = self.args_model.model_validate(arguments)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors())
            raise _ArgError("invalid_arguments", f"invalid arguments for {self.name}: {problems}. "
                            f"Schema: {json.dumps(self.parameters)}") from None
        return {k: getattr(parsed, k) for k in type(parsed).model_fields}

    async def run(self, arguments: str | dict[str, Any] | None) -> ToolResult:
        """Validate, call with a timeout, serialise. Never raises for the model's or the tool's errors."""
        start = time.perf_counter()

        def result(content: str, error: str | None = None, kind: str | None = None, value: Any = None) -> ToolResult:
            return ToolResult(self.name, content, error, kind, time.perf_counter() - start, value)

        try:
            kwargs = self.validate(arguments)
        except _ArgError as e:
            return result(f"Error: {e.message}", e.message, e.kind)
        try:
            if self.is_async:
                coro = self.fn(**kwargs)
            else:
                coro = asyncio.to_thread(self.fn, **kwargs)
            value = await asyncio.wait_for(coro, self.timeout_s) if self.timeout_s else await coro
        except asyncio.TimeoutError:
            msg = f"tool {self.name} timed out after {self.timeout_s:g} s"
            return result(f"Error: {msg}", msg, "timeout")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the tool's own failure: reported to the model, the run goes on
            msg = f"tool {self.name} raised {type(e).__name__}: {e}"
            return result(f"Error: {msg}", msg, "exception")
        try:
            content = self._serialize(value)
        except Exception as e:
            msg = f"tool {self.name} returned a value that cannot be serialised: {type(e).__name__}: {e}"
            return result(f"Error: {msg}", msg, "exception")
        return result(content, value=value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the underlying function directly, as plain Python."""
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


class _ArgError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def default_serialize(value: Any) -> str:
    """Strings pass through; pydantic models, dataclasses and JSON-able values become JSON.

    Arrays are not handled here on purpose: a tool that returns large arrays saves them with
    :mod:`closedloop.artifacts` and returns the reference, so they travel as paths.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        value = dataclasses.asdict(value)
    return json.dumps(value, default=_json_default)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if hasattr(obj, "tolist"):  # numpy scalars / small arrays
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None,
         timeout_s: float | None = 60.0, mutates: bool = False, registry: "ToolRegistry | None" = None) -> Any:
    """Make a :class:`Tool` from a typed function: ``@tool`` or ``@tool(name=..., timeout_s=...)``.

    ``mutates=True`` marks a write tool (graders replay only those). ``registry`` registers it.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        t = Tool(f, name=name, description=description, timeout_s=timeout_s, mutates=mutates)
        if registry is not None:
            registry.register(t)
        return t

    return wrap(fn) if fn is not None else wrap


@dataclass
class ToolRegistry:
    """Tools by name. Duplicate names are rejected; a missing name lists what exists."""

    tools: dict[str, Tool] = field(default_factory=dict)

    def register(self, t: Tool) -> Tool:
        if t.name in self.tools and self.tools[t.name] is not t:
            raise ToolDefinitionError(f"a tool named {t.name!r} is already registered")
        self.tools[t.name] = t
        return t

    def extend(self, tools: "list[Tool] | ToolRegistry") -> "ToolRegistry":
        for t in (tools.tools.values() if isinstance(tools, ToolRegistry) else tools):
            self.register(t)
        return self

    def get(self, name: str) -> Tool:
        try:
            return self.tools[name]
        except KeyError:
            raise KeyError(f"no tool named {name!r}; available: {sorted(self.tools)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def __iter__(self):
        return iter(self.tools.values())

    def __len__(self) -> int:
        return len(self.tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one model-issued tool call; an unknown name is an error for the model, not a crash."""
        if call.name not in self.tools:
            msg = f"unknown tool {call.name!r}; available tools: {sorted(self.tools)}"
            return ToolResult(call.name, f"Error: {msg}", msg, "unknown_tool")
        return await self.tools[call.name].run(call.function.arguments)

    async def call_json(self, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        return await self.call(ToolCall.make(name, arguments))


# Tools that plugins (closedloop.tools.*) register on import; see closedloop.plugins.
DEFAULT_REGISTRY = ToolRegistry()
