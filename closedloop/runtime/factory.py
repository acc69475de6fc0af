"""The graph-factory contract every agent graph implements, and serving a factory by config.

A graph is registered by a factory (entry point group ``closedloop.graphs``) with the signature of
:class:`GraphFactory`: a model client and a tool registry in, a compiled LangGraph graph out, with
the standard keyword options. The CLI (``closedloop run``), the τ-bench agents, trainers' rollouts
and the LangGraph server all build graphs through it, so a plugin graph that honours it works in
all of them. Extra keyword options are allowed after the standard ones (with defaults).

``langgraph dev`` / LangGraph Platform instead call a function of the run's config
(``langgraph.json`` points at one per graph, e.g. ``graphs/react.py:make_graph``);
:func:`served_graph` turns a factory into that: the model spec, tools and options come from the
run's ``configurable`` (or ``context``) keys listed in :data:`CONFIG_KEYS`.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Collection, Protocol, runtime_checkable

from closedloop.models.base import ModelClient, SamplingParams
from closedloop.tool import ToolRegistry

STANDARD_OPTIONS = ("system_prompt", "params", "max_turns", "approve", "stream_tokens", "execute_tools",
                    "checkpointer")


@runtime_checkable
class GraphFactory(Protocol):
    """``factory(client, tools, *, system_prompt, params, max_turns, approve, stream_tokens,
    execute_tools, checkpointer) -> compiled graph``.

    - ``client``: the policy model (:class:`ModelClient`); ``tools``: the registry, or ``None``.
    - ``system_prompt``: ``None`` for none; a factory has its own default.
    - ``params``: sampling; a run may override the seed (``configurable["sampling_seed"]``).
    - ``max_turns``: model calls per invocation (a thread may go on indefinitely).
    - ``approve``: ``True``/``False`` or tool names that pause for review (LangChain's HITL shape).
    - ``stream_tokens``: text deltas on the ``custom`` stream (``{"token": ...}``).
    - ``execute_tools=False``: end after each model turn (an environment runs the tools).
    - ``checkpointer``: a LangGraph saver, or ``None``.

    The compiled graph's state has ``messages`` (any form, :mod:`closedloop.runtime.convert`),
    ``turns`` (the policy's :class:`~closedloop.messages.Turn`s, the training record) and
    ``tool_records``.
    """

    def __call__(self, client: ModelClient, tools: ToolRegistry | None = None, *, system_prompt: str | None = ...,
                 params: SamplingParams | None = None, max_turns: int = 8, approve: bool | Collection[str] = False,
                 stream_tokens: bool = False, execute_tools: bool = True, checkpointer: Any = None) -> Any: ...


def check_factory(factory: Any, name: str = "") -> None:
    """Raise ``TypeError`` naming what is missing when ``factory`` does not take the standard arguments."""
    if not callable(factory):
        raise TypeError(f"graph {name or factory!r} is not callable")
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check
    params = sig.parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    missing = [o for o in STANDARD_OPTIONS if o not in params]
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 or missing:
        raise TypeError(f"graph factory {name or getattr(factory, '__name__', factory)} does not follow "
                        f"closedloop.runtime.factory.GraphFactory: it needs (client, tools, *, "
                        f"{', '.join(STANDARD_OPTIONS)}); missing: {', '.join(missing) or 'client, tools'}")


#: Keys a served graph reads from ``config["configurable"]`` (or the run's ``context``).
CONFIG_KEYS = {
    "model": "model spec (hf:..., openai:...@url, vllm:...); default $CLOSEDLOOP_MODEL",
    "tools": "comma-separated tool modules (or a list); default 'arithmetic'; '' for none",
    "system_prompt": "system prompt (default: the graph's)",
    "max_turns": "model calls per invocation",
    "approve": "true, or a list of tool names that pause for review",
    "temperature": "sampling temperature (default 0)", "max_tokens": "completion cap (default 256)",
    "seed": "sampling seed",
}

_TOOLS: dict[tuple[str, ...], ToolRegistry] = {}


class MissingModel(ModelClient):
    """Stands in when a served graph is built without a model (the server's schema pass); a call says what to set."""

    spec = "missing:"

    async def generate(self, messages, tools=None, params=None, tool_choice=None):  # type: ignore[override]
        raise ValueError("no model chosen: set configurable.model (e.g. 'hf:/path/to/model' or "
                         "'openai:name@http://host/v1') or $CLOSEDLOOP_MODEL")


def served_options(config: Any) -> dict[str, Any]:
    """The ``configurable``/``context`` keys of a run's config, merged (context wins)."""
    config = config or {}
    merged = dict(config.get("configurable") or {})
    context = config.get("context")
    if isinstance(context, dict):
        merged.update(context)
    return merged


def served_graph(factory: GraphFactory, config: Any, **defaults: Any) -> Any:
    """Build ``factory``'s graph for one server run from its config (see :data:`CONFIG_KEYS`).

    Model clients and tool registries are cached per process, so a served graph loads an ``hf:``
    model once. No checkpointer is passed: the server brings its own (our types revive in it).
    """
    from closedloop import plugins
    from closedloop.langchain_chat import shared_client

    opts = {**defaults, **served_options(config)}
    spec = opts.get("model") or os.environ.get("CLOSEDLOOP_MODEL")
    client: ModelClient = shared_client(spec) if spec else MissingModel()
    tools_opt = opts.get("tools", "arithmetic")
    modules = tuple(m for m in (tools_opt.split(",") if isinstance(tools_opt, str) else tools_opt or []) if m)
    if modules not in _TOOLS:
        _TOOLS[modules] = plugins.tool_registry(list(modules)) if modules else ToolRegistry()
    params = SamplingParams(temperature=float(opts.get("temperature", 0.0)), max_tokens=int(opts.get("max_tokens", 256)),
                            seed=opts.get("seed"))
    kwargs: dict[str, Any] = {"params": params, "approve": opts.get("approve", False)}
    if "system_prompt" in opts:
        kwargs["system_prompt"] = opts["system_prompt"]
    if "max_turns" in opts:
        kwargs["max_turns"] = int(opts["max_turns"])
    return factory(client, _TOOLS[modules], **kwargs)


__all__ = ["GraphFactory", "STANDARD_OPTIONS", "check_factory", "CONFIG_KEYS", "MissingModel", "served_options",
           "served_graph"]
