"""The run context of an agent graph: the model, tools and settings one run works with.

Every closedloop graph is one module-level compiled LangGraph graph whose ``context_schema`` is
:class:`AgentContext` (or a subclass adding the graph's own settings). The caller passes the
context per run, LangGraph hands it to the nodes (``runtime.context``), and nothing is bound at
compile time::

    from closedloop.graphs.react import graph
    out = await graph.ainvoke({"messages": [...]}, context=AgentContext(client=client, tools=tools))

Why a context and not a closure over (client, tools): one compiled graph then serves every client,
tool set and seed (a trainer's rollout batch, τ episodes, a server's runs) without compiling a
graph per combination and keeping caches of them; the graph is plain data that ``langgraph dev``
serves and Studio draws.

The fields are JSON for a server run (``langgraph dev`` sends ``context``, or ``configurable``,
as a dict that LangGraph validates into the schema): ``model`` is then a spec resolved through
:func:`client_for` and ``tools`` names tool modules. In Python, ``client`` and ``tools`` take the
objects themselves.

A setting left unset takes the graph's default: a subclass declares its own defaults
(:class:`~closedloop.graphs.factguard.FactGuardContext` has the paper's system prompt), and a
plain ``AgentContext`` given to such a graph is read with that graph's defaults for what it did
not set (:func:`context_of`).
"""

from __future__ import annotations

import os
import threading
from typing import Annotated, Any, TypeVar

from langgraph.runtime import Runtime
from pydantic import BaseModel, ConfigDict, Field, InstanceOf, WithJsonSchema, field_validator
from pydantic.json_schema import SkipJsonSchema

from closedloop.models.base import ModelClient, SamplingParams
from closedloop.tool import Tool, ToolRegistry

DEFAULT_SYSTEM_PROMPT = ("You are a helpful assistant. Use the tools when they help; "
                         "answer the user directly when you have what you need.")

_CLIENTS: dict[str, ModelClient] = {}
_CLIENTS_LOCK = threading.Lock()


def client_for(spec: str) -> ModelClient:
    """The process's client for a model spec, made on first use.

    A server run names its model by spec; making a client per run would load an ``hf:`` model's
    weights per request, so the process keeps one client per spec (the role LangGraph's own
    examples give to module-level model objects). Contexts given a ``client`` never come here.
    """
    with _CLIENTS_LOCK:
        if spec not in _CLIENTS:
            from closedloop.models import make_client

            _CLIENTS[spec] = make_client(spec)
        return _CLIENTS[spec]


_TOOLS_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
                 "description": "tool modules (see `closedloop tools`), comma-separated or a list; in Python a "
                                "ToolRegistry or a list of tools"}


class AgentContext(BaseModel):
    """What one run of an agent graph works with (LangGraph's run ``context``).

    - ``client`` (Python) or ``model`` (a spec: ``hf:<path>``, ``openai:<model>[@<url>]``, ...;
      default ``$CLOSEDLOOP_MODEL``): the policy model.
    - ``tools``: the registry the tool node runs (module names from JSON); ``tool_schemas``: what
      the model is offered instead, when an environment executes the calls (``execute_tools=False``)
      and has given only their schemas.
    - ``params``: sampling (the backend's defaults when None); the seed of a run is ``params.seed``.
    - ``system_prompt``: prepended to the model's input when the conversation has none; None for
      none; unset for the graph's default.
    - ``max_turns``: model calls per invocation (a thread may go on indefinitely).
    - ``approve``: True, or the tool names that pause for review (LangChain's HITL shape).
    - ``stream_tokens``: text deltas on LangGraph's ``custom`` stream (``{"token": ...}``).
    - ``execute_tools=False``: end after each model turn (an environment runs the tools).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    client: SkipJsonSchema[InstanceOf[ModelClient] | None] = Field(
        None, description="the policy model client (Python callers); takes precedence over model")
    model: str | None = Field(None, description="model spec (hf:..., openai:name@url, vllm:...); "
                                                "default $CLOSEDLOOP_MODEL")
    tools: Annotated[InstanceOf[ToolRegistry], WithJsonSchema(_TOOLS_SCHEMA)] = Field(default_factory=ToolRegistry)
    tool_schemas: list[dict[str, Any]] | None = Field(
        None, description="tool schemas offered to the model instead of tools' own (execute_tools=false)")
    params: SamplingParams | None = Field(None, description="sampling settings; the seed of the run is params.seed")
    system_prompt: str | None = Field(DEFAULT_SYSTEM_PROMPT, description="null for none; unset for the graph's")
    max_turns: int = Field(8, ge=1, description="model calls per invocation")
    approve: bool | list[str] = Field(False, description="true, or the tool names that pause for review")
    stream_tokens: bool = Field(False, description="text deltas on the custom stream as {'token': ...}")
    execute_tools: bool = Field(True, description="false: end after each model turn (an environment runs tools)")

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_modules(cls, value: Any) -> Any:
        if value is None:
            return ToolRegistry()
        if isinstance(value, str):
            value = [m for m in (v.strip() for v in value.split(",")) if m]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            from closedloop import plugins

            return plugins.tool_registry(list(value)) if value else ToolRegistry()
        if isinstance(value, (list, tuple)) and all(isinstance(v, Tool) for v in value):
            return ToolRegistry().extend(list(value))
        return value

    def model_client(self) -> ModelClient:
        """The policy model: ``client``, else the process's client for ``model`` (or ``$CLOSEDLOOP_MODEL``)."""
        if self.client is not None:
            return self.client
        spec = self.model or os.environ.get("CLOSEDLOOP_MODEL")
        if not spec:
            raise ValueError("no model chosen: set the run context's model (e.g. 'hf:/path/to/model' or "
                             "'openai:name@http://host/v1'), its client, or $CLOSEDLOOP_MODEL")
        return client_for(spec)

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tool schemas the model is offered (None for none)."""
        if self.tool_schemas is not None:
            return list(self.tool_schemas) or None
        return self.tools.schemas if len(self.tools) else None

    def needs_approval(self, name: str) -> bool:
        return self.approve if isinstance(self.approve, bool) else name in self.approve


C = TypeVar("C", bound=AgentContext)


def context_of(runtime: Runtime[Any], schema: type[C]) -> C:
    """The run's context read as ``schema`` (a graph's own context class).

    LangGraph validates a dict context into the graph's schema itself; an object is passed as it
    is, so a plain :class:`AgentContext` (or none) given to a graph with its own schema is read
    here with that schema's defaults for every field the caller did not set.
    """
    ctx = runtime.context
    if isinstance(ctx, schema):
        return ctx
    if ctx is None:
        return schema()
    if isinstance(ctx, dict):
        return schema(**ctx)
    if isinstance(ctx, AgentContext):
        return schema(**{name: getattr(ctx, name) for name in ctx.model_fields_set})
    raise TypeError(f"the run context must be a {schema.__name__} (or a dict of its fields), "
                    f"got {type(ctx).__name__}")


__all__ = ["AgentContext", "DEFAULT_SYSTEM_PROMPT", "client_for", "context_of"]
