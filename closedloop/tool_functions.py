"""Typed async functions for tools described elsewhere: a LangChain tool, or a JSON schema.

:class:`closedloop.tool.Tool` builds its argument model and schema from a function's signature;
these functions give it one. They live below both ``tool`` (whose ``ToolRegistry.register``
converts a LangChain tool it is given) and ``langchain_tools`` (the public interop), so neither
imports the other's way back.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Awaitable, Callable, Literal, Optional, Union

from langchain_core.tools import BaseTool
from pydantic import BaseModel, ConfigDict, Field, create_model

__all__ = ["model_from_schema", "signature_function", "langchain_function", "langchain_tool_keywords"]

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


def signature_function(args_model: type[BaseModel], call: Callable[..., Awaitable[Any]], name: str) -> Callable[..., Any]:
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


def langchain_function(lc_tool: BaseTool) -> Callable[..., Awaitable[Any]]:
    """An async function calling a LangChain tool, its signature the tool's model-facing arguments
    (``tool_call_schema``, injected ones left out; a JSON schema or a pydantic v1 model's becomes a
    model of ours). Errors are the caller's to report, as for any tool function."""
    schema = lc_tool.tool_call_schema

    async def call(**kwargs: Any) -> Any:
        args = {k: v for k, v in kwargs.items() if v is not None or k in required}
        value = await lc_tool.ainvoke(args)
        return getattr(value, "content", value)  # a ToolMessage (content_and_artifact tools) → its content

    if isinstance(schema, type) and issubclass(schema, BaseModel):
        required = {k for k, f in schema.model_fields.items() if f.is_required()}
        return signature_function(schema, call, lc_tool.name)
    whole = schema if isinstance(schema, dict) else schema.schema()
    parameters = whole.get("parameters", whole)
    required = set(parameters.get("required", []))
    return signature_function(model_from_schema(parameters or {"type": "object", "properties": {}},
                                                f"{lc_tool.name}_args"), call, lc_tool.name)


def langchain_tool_keywords(obj: Any) -> dict[str, Any]:
    """``Tool``'s keywords for a LangChain tool (function, name, description; the rest at
    ``Tool``'s defaults); anything else is a ``TypeError`` saying what may be registered."""
    if not isinstance(obj, BaseTool):
        raise TypeError(f"cannot register {type(obj).__name__} {obj!r:.80} as a tool: use @closedloop.tool.tool on a "
                        "typed function, or a LangChain BaseTool")
    return {"fn": langchain_function(obj), "name": obj.name, "description": obj.description or obj.name}
