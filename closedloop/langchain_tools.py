"""LangChain tools ⇄ our tools.

- :func:`from_langchain_tool`: a LangChain ``BaseTool`` (``@tool``, ``StructuredTool``, a
  ``BaseTool`` subclass) becomes our :class:`~closedloop.tool.Tool`, so it goes through the same
  path as every tool of ours: JSON schema from its ``tool_call_schema``, pydantic validation of the
  model's arguments before the call, timeout, and every error (bad JSON, bad arguments,
  ``ToolException``, any exception) returned to the model as a tool message instead of raised.
  ``ToolRegistry.register`` calls it for any ``BaseTool`` it is given.
- :func:`to_langchain_tool`: our ``Tool`` as a LangChain ``StructuredTool`` (same name,
  description and argument model), for ``bind_tools``, ``ToolNode`` or ``create_agent``.
- :func:`schema_tool`: a tool from a name, a JSON schema and an async callable, for sources that
  describe tools by JSON schema only (MCP servers); the schema becomes a pydantic model.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Awaitable, Callable, Literal, Optional, Union

from langchain_core.tools import BaseTool, StructuredTool
from pydantic import BaseModel, ConfigDict, Field, create_model

from closedloop.run_sync import run_sync
from closedloop.tool import Tool, ToolResult

_JSON_TYPES: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool, "null": type(None),
                               "array": list, "object": dict}


def _type_from_schema(schema: dict[str, Any], name: str) -> Any:
    """A Python type for a JSON-schema property (enums as Literal, nested objects as models)."""
    if not isinstance(schema, dict):
        return Any
    if "enum" in schema and all(isinstance(v, (str, int, bool)) for v in schema["enum"]):
        return Literal[tuple(schema["enum"])]  # type: ignore[misc]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = tuple(_type_from_schema(s, name) for s in schema[key])
            return Union[options] if len(options) > 1 else options[0]  # type: ignore[return-value]
    kind = schema.get("type")
    if isinstance(kind, list):
        options = tuple(_type_from_schema({**schema, "type": k}, name) for k in kind)
        return Union[options] if len(options) > 1 else options[0]  # type: ignore[return-value]
    if kind == "array":
        return list[_type_from_schema(schema.get("items", {}), name)]  # type: ignore[misc]
    if kind == "object" and "properties" in schema:
        return model_from_schema(schema, f"{name}_obj", extra="allow")
    if kind == "object":
        return dict[str, Any]
    return _JSON_TYPES.get(kind, Any) if kind else Any


def model_from_schema(schema: dict[str, Any], name: str, *, extra: Literal["forbid", "allow"] = "forbid") -> type[BaseModel]:
    """A pydantic model validating what a JSON object schema describes (types, required, defaults, enums).

    Constraints pydantic cannot express from these keywords (patterns, min/max) are left to the
    tool itself, which reports a violation as an error the model sees.
    """
    required = set(schema.get("required", []))
    fields: dict[str, Any] = {}
    for pname, prop in (schema.get("properties") or {}).items():
        typ = _type_from_schema(prop, f"{name}_{pname}")
        desc = prop.get("description") if isinstance(prop, dict) else None
        if pname in required:
            fields[pname] = (typ, Field(..., description=desc))
        else:
            default = prop.get("default") if isinstance(prop, dict) else None
            fields[pname] = (Optional[typ], Field(default, description=desc))
    return create_model(name, __config__=ConfigDict(extra=extra), **fields)


def _signature_fn(args_model: type[BaseModel], call: Callable[..., Awaitable[Any]], name: str) -> Callable[..., Any]:
    """An async function whose signature is ``args_model``'s fields, so :class:`Tool` builds the same
    validation model from it as it does for a typed function of ours."""

    async def fn(**kwargs: Any) -> Any:
        return await call(**kwargs)

    params, annotations = [], {}
    for field_name, info in args_model.model_fields.items():
        default = inspect.Parameter.empty if info.is_required() else info.default
        # constraints (ge, le, pattern, ...) travel as Annotated metadata, so validation keeps them
        annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        params.append(inspect.Parameter(field_name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotation))
        annotations[field_name] = annotation
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__annotations__ = annotations
    fn.__name__ = name
    fn.__doc__ = "\n".join(["Tool.", "", "Args:"] + [f"    {k}: {v.description}" for k, v in args_model.model_fields.items()
                                                     if v.description])
    return fn


def schema_tool(name: str, description: str, parameters: dict[str, Any], call: Callable[..., Awaitable[Any]], *,
                timeout_s: float | None = 60.0, mutates: bool = False) -> Tool:
    """Our tool from a JSON schema and an async callable taking the validated arguments as keywords."""
    model = model_from_schema(parameters or {"type": "object", "properties": {}}, f"{name}_args")
    return Tool(_signature_fn(model, call, name), name=name, description=description or name,
                timeout_s=timeout_s, mutates=mutates)


def from_langchain_tool(lc_tool: BaseTool, *, timeout_s: float | None = 60.0, mutates: bool = False) -> Tool:
    """Our :class:`Tool` calling a LangChain tool (see the module docstring)."""
    if not isinstance(lc_tool, BaseTool):
        raise TypeError(f"expected a LangChain BaseTool, got {type(lc_tool).__name__}")
    schema = lc_tool.tool_call_schema  # the model-facing arguments (injected ones left out)

    async def call(**kwargs: Any) -> Any:
        args = {k: v for k, v in kwargs.items() if v is not None or k in required}
        value = await lc_tool.ainvoke(args)
        return getattr(value, "content", value)  # a ToolMessage (content_and_artifact tools) → its content

    if isinstance(schema, type) and issubclass(schema, BaseModel):
        required = {k for k, f in schema.model_fields.items() if f.is_required()}
        return Tool(_signature_fn(schema, call, lc_tool.name), name=lc_tool.name,
                    description=lc_tool.description or lc_tool.name, timeout_s=timeout_s, mutates=mutates)
    # a JSON schema, or a pydantic v1 model's: the schema becomes a model of ours
    whole = schema if isinstance(schema, dict) else schema.schema()
    parameters = whole.get("parameters", whole)
    required = set(parameters.get("required", []))
    return schema_tool(lc_tool.name, lc_tool.description, parameters, call, timeout_s=timeout_s, mutates=mutates)


def to_langchain_tool(tool: Tool) -> BaseTool:
    """Our tool as a LangChain ``StructuredTool``; errors come back as the tool's error text, as with us."""
    if isinstance(tool, BaseTool):
        return tool

    async def acall(**kwargs: Any) -> str:
        result: ToolResult = await tool.run(kwargs)
        return result.content

    def call(**kwargs: Any) -> str:
        return run_sync(lambda: acall(**kwargs))

    return StructuredTool.from_function(func=call, coroutine=acall, name=tool.name, description=tool.description,
                                        args_schema=tool.args_model, infer_schema=False)


def coerce_tool(obj: Any) -> Tool:
    """Our tool for anything ``ToolRegistry.register`` is given (a ``Tool`` as is, a LangChain tool converted)."""
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, BaseTool):
        return from_langchain_tool(obj)
    raise TypeError(f"cannot register {type(obj).__name__} {obj!r:.80} as a tool: use @closedloop.tool.tool on a typed "
                    "function, or a LangChain BaseTool")


__all__ = ["from_langchain_tool", "to_langchain_tool", "schema_tool", "model_from_schema", "coerce_tool"]

