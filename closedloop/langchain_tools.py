"""LangChain tools ⇄ our tools.

- :func:`from_langchain_tool`: a LangChain ``BaseTool`` (``@tool``, ``StructuredTool``, a
  ``BaseTool`` subclass) becomes our :class:`~closedloop.tool.Tool`, so it goes through the same
  path as every tool of ours: JSON schema from its ``tool_call_schema``, pydantic validation of the
  model's arguments before the call, timeout, and every error (bad JSON, bad arguments,
  ``ToolException``, any exception) returned to the model as a tool message instead of raised.
  ``ToolRegistry.register`` converts any ``BaseTool`` it is given the same way
  (:mod:`closedloop.tool_functions`, below both modules).
- :func:`to_langchain_tool`: our ``Tool`` as a LangChain ``StructuredTool`` (same name,
  description and argument model), for ``bind_tools``, ``ToolNode`` or ``create_agent``.
- :func:`schema_tool`: a tool from a name, a JSON schema and an async callable, for sources that
  describe tools by JSON schema only (MCP servers); the schema becomes a pydantic model.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from langchain_core.tools import BaseTool, StructuredTool

from closedloop.run_sync import run_sync
from closedloop.tool import Tool, ToolRegistry, ToolResult
from closedloop.tool_functions import langchain_tool_keywords, model_from_schema, signature_function


def schema_tool(name: str, description: str, parameters: dict[str, Any], call: Callable[..., Awaitable[Any]], *,
                timeout_s: float | None = 60.0, mutates: bool = False) -> Tool:
    """Our tool from a JSON schema and an async callable taking the validated arguments as keywords."""
    model = model_from_schema(parameters or {"type": "object", "properties": {}}, f"{name}_args")
    return Tool(signature_function(model, call, name), name=name, description=description or name,
                timeout_s=timeout_s, mutates=mutates)


def from_langchain_tool(lc_tool: BaseTool, *, timeout_s: float | None = 60.0, mutates: bool = False) -> Tool:
    """Our :class:`Tool` calling a LangChain tool (see the module docstring)."""
    if not isinstance(lc_tool, BaseTool):
        raise TypeError(f"expected a LangChain BaseTool, got {type(lc_tool).__name__}")
    return Tool(**langchain_tool_keywords(lc_tool), timeout_s=timeout_s, mutates=mutates)


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
    """Our tool for anything ``ToolRegistry.register`` is given (a ``Tool`` as is, a LangChain tool
    converted, anything else a ``TypeError``): what ``register`` itself does."""
    return obj if isinstance(obj, Tool) else ToolRegistry().register(obj)


__all__ = ["from_langchain_tool", "to_langchain_tool", "schema_tool", "model_from_schema", "coerce_tool"]

