"""An environment: one domain's toolkit bound to one live DB instance.

Everything that changes state goes through here, so the evaluator can rebuild any state by
replaying calls into a fresh environment and comparing hashes.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from closedloop.evals.tau.data_model import EnvAssertion, EnvFunctionCall, InitialState
from closedloop.evals.tau.domains.base import DISPATCHER_PARAMETERS, TauDB, Toolkit
from closedloop.evals.tau.domains.registry import Domain
from closedloop.messages import ToolCall, ToolMessage
from closedloop.tool import Tool, ToolRegistry, ToolResult

__all__ = ["Environment", "EnvironmentFactory", "decode_json_string_args", "dispatcher_conflict"]

# tau2 runs every call as ``make_tool_call(call.name, requestor=call.requestor, **call.arguments)``
# (``Environment.get_response``): arguments named like that method's own parameters never reach the tool.
_TAU2_DISPATCHER = "Environment.make_tool_call()"
_TAU2_DISPATCHER_MODULE = "tau2.environment.environment"


def dispatcher_conflict(arguments: Any) -> str | None:
    """tau2's TypeError text for a call whose arguments collide with its dispatcher's parameters
    (``requestor``, ``tool_name``, ``self``), or None. Python 3.12's own wording, which tau2
    requires: a duplicate of the explicit ``requestor=`` keyword is caught at the call site,
    which names the function with its module; ``self`` and ``tool_name`` are caught while
    binding, keyword by keyword in the order the model sent them."""
    if not isinstance(arguments, dict):
        return None
    if "requestor" in arguments:
        return f"{_TAU2_DISPATCHER_MODULE}.{_TAU2_DISPATCHER} got multiple values for keyword argument 'requestor'"
    for key in arguments:
        if key in DISPATCHER_PARAMETERS:
            return f"{_TAU2_DISPATCHER} got multiple values for argument '{key}'"
    return None


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value
    return base


class Environment:
    """Tools bound to a DB (and, for dual-control domains, user tools bound to a user DB).

    With ``copy_db``, ``db`` is a pristine instance shared with other environments: it is only
    read until the first write (a mutating tool, a toolkit function, new initialization data,
    ``.db`` itself), which first swaps in a private copy from ``copy_db()``; until then
    ``shared_hash()`` gives its hash. Tools read ``toolkit.db`` on every call, so the swap needs
    no rebinding. Only tools marked ``mutates`` may change state: a read tool that wrote would
    change every environment sharing the instance.
    """

    def __init__(self, domain: Domain, db: TauDB, *, user_db: TauDB | None = None, policy: str = "",
                 options: dict[str, Any] | None = None, descriptions: dict[str, str] | None = None,
                 user_descriptions: dict[str, str] | None = None,
                 copy_db: Callable[[], TauDB] | None = None, shared_hash: Callable[[], str] | None = None) -> None:
        if copy_db is not None and (user_db is not None or shared_hash is None):
            raise ValueError("a shared DB needs shared_hash and no user DB")
        self._copy_db, self._shared_hash = copy_db, shared_hash
        self.domain = domain
        self.policy = policy
        self.options: dict[str, Any] = dict(options or {})
        self.toolkit: Toolkit = domain.toolkit(db, descriptions=descriptions, **self.options)
        self.user_toolkit: Toolkit | None = None
        if user_db is not None and domain.user_toolkit is not None:
            self.user_toolkit = domain.user_toolkit(user_db, descriptions=user_descriptions, **self.options)
        self.sync_tools()

    def sync_tools(self) -> None:
        """tau2 ``Environment.sync_tools``: dual-control domains reconcile their two DBs here."""
        hook = getattr(self.domain, "sync_tools", None)
        if hook is not None:
            hook(self)

    # ------------------------------------------------------------------ state

    def _own(self) -> None:
        """Before a write: a private copy in place of the shared pristine DB."""
        if self._copy_db is not None:
            copy_db, self._copy_db, self._shared_hash = self._copy_db, None, None
            self.toolkit.db = copy_db()

    @property
    def db(self) -> TauDB:
        self._own()  # the caller may write through it
        return self.toolkit.db

    @property
    def user_db(self) -> TauDB | None:
        return self.user_toolkit.db if self.user_toolkit is not None else None

    def get_db_hash(self) -> str:
        if self._shared_hash is not None:
            return self._shared_hash()
        return self.toolkit.db.get_hash()

    def get_user_db_hash(self) -> str | None:
        return self.user_toolkit.db.get_hash() if self.user_toolkit is not None else None

    def apply_initial_state(self, initial_state: InitialState | None) -> None:
        """tau2 ``set_state`` before any message: merge initialization data, run init actions."""
        if initial_state is None:
            return
        data = initial_state.initialization_data
        if data is not None and data.agent_data:
            self._replace_db(self.toolkit, _deep_merge(self.toolkit.db.model_dump(), data.agent_data))
            self._copy_db = self._shared_hash = None  # the toolkit now holds a DB of its own
        if data is not None and data.user_data:
            if self.user_toolkit is None:
                raise ValueError(f"task sets user_data but domain {self.domain.name!r} has no user DB")
            self._replace_db(self.user_toolkit, _deep_merge(self.user_toolkit.db.model_dump(), data.user_data))
        for call in initial_state.initialization_actions or []:
            self.call_function(call)
        self.sync_tools()  # tau2's set_state ends with one (after initialization data too)

    @staticmethod
    def _replace_db(toolkit: Toolkit, data: dict[str, Any]) -> None:
        new_db = type(toolkit.db).model_validate(data)
        type(toolkit).__init__(toolkit, new_db, descriptions=toolkit._descriptions, **toolkit.options)  # rebind the tools

    # ------------------------------------------------------------------ tools

    @property
    def tools(self) -> ToolRegistry:
        return self.toolkit.tools

    @property
    def user_tools(self) -> ToolRegistry | None:
        return self.user_toolkit.tools if self.user_toolkit is not None else None

    @property
    def tool_list(self) -> list[Tool]:
        return list(self.toolkit.tools)

    def _kit(self, requestor: str) -> Toolkit:
        if requestor == "user":
            if self.user_toolkit is None:
                raise ValueError(f"domain {self.domain.name!r} has no user tools")
            return self.user_toolkit
        return self.toolkit

    def is_mutating_tool(self, name: str, requestor: str = "assistant") -> bool:
        kit = self.user_toolkit if requestor == "user" else self.toolkit
        return kit is not None and kit.is_mutating(name)

    def run_tool_call(self, call: ToolCall, requestor: str = "assistant") -> ToolMessage:
        """Execute one model-issued call (tau2 ``get_response``); every failure becomes an error
        tool message, with tau2's text: a dispatcher-named argument first, then a side without
        tools, then an unknown tool, then whatever the tool raises."""
        registry = self.tools if requestor == "assistant" else self.user_tools
        conflict = dispatcher_conflict(_parsed(call.function.arguments))
        if conflict is not None:
            result = ToolResult(call.name, f"Error: {conflict}", conflict, "invalid_arguments")
        elif registry is None:
            msg = "User tools not available"
            result = ToolResult(call.name, f"Error: {msg}", msg, "unknown_tool")
        elif call.name not in registry:
            msg = f"Tool '{call.name}' not found."
            result = ToolResult(call.name, f"Error: {msg}", msg, "unknown_tool")
        else:
            tool = registry.get(call.name)
            if requestor != "assistant" or tool.mutates:
                self._own()
            arguments: Any = call.function.arguments
            if self.options.get("json_string_args"):
                arguments = decode_json_string_args(tool, arguments)
            result = tool.call(arguments)  # type: ignore[attr-defined]
            if result.ok:
                self.sync_tools()
        return result.to_message(call.id)

    def make_tool_call(self, tool_name: str, requestor: str = "assistant", **kwargs: Any) -> Any:
        """Call a tool by name and return its Python value; raises on any error (gold replay).

        As tau2's ``make_tool_call`` (same parameter names, so the same arguments collide with
        them), it does not call ``sync_tools``: tau2's evaluator builds the gold state this way,
        while live calls (:meth:`run_tool_call`) sync."""
        kit = self._kit(requestor)
        if tool_name not in kit.tools:
            raise KeyError(f"Tool '{tool_name}' not found.")
        if requestor != "assistant" or kit.is_mutating(tool_name):
            self._own()
        return kit.tools.get(tool_name).fn(**kwargs)  # raw kwargs, as tau2 calls its tools

    def call_function(self, call: EnvFunctionCall) -> Any:
        """A toolkit function (tool or assertion helper) by name; raises on error."""
        self._own()  # init actions write; assertions are not marked, so they are treated alike
        kit = self._kit(call.env_type)
        value = kit.function(call.func_name)(**call.arguments)
        self.sync_tools()
        return value

    def run_env_assertion(self, assertion: EnvAssertion) -> tuple[bool, str | None]:
        """(met, error): an assertion whose function raises or returns a non-bool is not met."""
        try:
            value = self.call_function(assertion)
        except Exception as e:
            return False, f"{type(e).__name__}: {e}"
        if not isinstance(value, bool):
            return False, f"{assertion.func_name} returned {type(value).__name__}, not bool"
        return value == assertion.assert_value, None

    def tool_schemas(self) -> list[dict[str, Any]]:
        return self.tools.schemas

    def describe(self) -> dict[str, Any]:
        """tau2 ``EnvironmentInfo``: domain name, policy and tool definitions."""
        return {"domain_name": self.domain.name, "policy": self.policy,
                "tool_defs": {t.name: json.loads(json.dumps(t.schema)) for t in self.tools}}


def _parsed(arguments: Any) -> Any:
    """A call's arguments as the tool would get them (a JSON text parsed; unparsable: None)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments or "{}")
        except json.JSONDecodeError:
            return None
    return arguments


def decode_json_string_args(tool: Tool, arguments: Any) -> Any:
    """Option ``json_string_args``: a list argument sent as a JSON-encoded string is decoded.

    tau2 (main) passes such a string to the tool as it is, where it is iterated character by
    character ("Error: [ not found"); some models send lists that way."""
    parsed = _parsed(arguments)
    if not isinstance(parsed, dict):
        return arguments
    arguments = parsed
    props = tool.parameters.get("properties", {})
    out = dict(arguments)
    for key, value in arguments.items():
        if isinstance(value, str) and props.get(key, {}).get("type") == "array" and value.strip().startswith("["):
            try:
                decoded = json.loads(value)
            except json.JSONDecodeError:
                continue
            if isinstance(decoded, list):
                out[key] = decoded
    return out


EnvironmentFactory = Callable[[], Environment]
