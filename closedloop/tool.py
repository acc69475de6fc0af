"""Typed tools: a Python function's signature and docstring are its schema.

``@tool`` turns a typed function (sync or async) into a :class:`Tool`. The same object serves the
OpenAI tools protocol (``tool.schema``), chat templates of local models (they take the same JSON
schema) and our LangGraph tool node (``await tool.run(arguments)``).

Errors are split by who can fix them, but all of them come back to the model as a tool message
and the run continues: malformed JSON and bad arguments (the model's fault) say what was wrong
and show the schema; exceptions and timeouts (the tool's fault) say so plainly. ``Tool.run`` never
raises (only a cancellation of the caller passes through).

Hostile or careless arguments are stopped before the tool runs: JSON text over a size limit,
nesting deeper than a limit, integers of hundreds of digits, NaN and infinities (the JSON tokens
and overflowing literals alike) and, through the tool's own ``estimate_bytes``, arguments whose
working set would exceed the tool's memory ceiling. A parameter typed
:data:`closedloop.tool_models.ModelArg` only accepts the models the operator allows (checkpoints
inside the working root by default), so no argument can point a tool, and its keys, at a URL. A
result that is not valid JSON (``NaN``, ``Infinity``) never reaches the model.

Where a call runs (``isolation``): ``"inline"`` awaits an async tool on the event loop (a timeout
cancels it), or calls a sync tool whose author declared it trivial (``isolation="inline"`` given
explicitly, e.g. arithmetic: it blocks the loop for its duration and has no timeout); ``"thread"`` runs a sync tool on a daemon worker thread (reused when idle, one more
when all are busy, never an executor's fixed pool), so a call that times out can
neither starve other tools nor keep the process from exiting, and it is counted as still running
until it ends (a tool with too many such calls is refused until they finish: a thread cannot be
stopped); ``"process"`` runs it in :mod:`closedloop.sandbox` (fresh interpreter, rlimits, memory
ceiling, wall-clock kill of the process group), for tools whose work must really stop.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import math
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from closedloop.messages import ToolCall, ToolMessage

__all__ = ["Tool", "ToolResult", "ToolRegistry", "tool", "ToolDefinitionError", "ArgumentLimits",
           "Isolation", "still_running", "parse_arguments", "ToolArgumentError"]

Isolation = Literal["inline", "thread", "process"]
# A tool's memory ceiling when it names none: the process sandbox's address-space limit, and the
# bound its ``estimate_bytes`` is checked against before the call.
DEFAULT_MEMORY_MB = int(os.environ.get("CLOSEDLOOP_TOOL_MEMORY_MB") or 4096)
# Calls of one thread-isolated tool that timed out and still run; beyond this the tool is refused.
MAX_STILL_RUNNING = 4


@dataclass(frozen=True)
class ArgumentLimits:
    """What a tool call's arguments may be, checked before validation and before the call.

    The defaults admit every real call we know (inline arrays up to tens of thousands of numbers)
    and stop the ones that crash parsers or allocate without bound.
    """

    max_bytes: int = 2_000_000  # JSON text of the arguments
    max_depth: int = 32  # nesting of objects and arrays
    max_items: int = 500_000  # values in the whole document
    max_int_bits: int = 1024  # |int| < 2**1024 (about 308 digits), the float range
    allow_non_finite: bool = False  # NaN and infinities anywhere in the arguments


class ToolDefinitionError(TypeError):
    """A function cannot become a tool (untyped parameter, duplicate name, ...)."""


@dataclass
class ToolResult:
    """What one tool call returned: content for the model, or an error that replaces it."""

    name: str
    content: str
    error: str | None = None
    # "malformed_json" | "invalid_arguments" | "unknown_tool" | "resource_limit" | "exception" | "timeout"
    error_kind: str | None = None
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
    """A callable tool with a JSON schema, argument validation, timeouts and error capture.

    ``isolation``: ``"inline"`` (async tools), ``"thread"`` (the default for sync tools) or
    ``"process"`` (the sandbox; the function must be importable, i.e. defined at module level).
    ``memory_mb`` is the tool's memory ceiling: the sandbox's address-space limit, and the bound
    that ``estimate_bytes(**arguments)`` (the call's peak working set in bytes, computed from the
    validated arguments before anything is allocated) must stay under. ``limits`` bounds the
    arguments themselves (:class:`ArgumentLimits`).
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                 timeout_s: float | None = 60.0, mutates: bool = False,
                 serialize: Callable[[Any], str] | None = None, isolation: Isolation | None = None,
                 memory_mb: int | None = None, estimate_bytes: Callable[..., float] | None = None,
                 limits: ArgumentLimits | None = None) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        if not re.fullmatch(r"[A-Za-z0-9_\-]{1,64}", self.name):
            raise ToolDefinitionError(f"tool name {self.name!r} must match [A-Za-z0-9_-]{{1,64}} (OpenAI's rule)")
        doc_desc, param_help = _parse_docstring(fn.__doc__ or "")
        self.description = description or doc_desc or self.name
        if timeout_s is not None and not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ToolDefinitionError(f"tool {self.name}: timeout_s must be a finite number > 0 or None")
        self.timeout_s = timeout_s
        self.mutates = mutates
        self.is_async = inspect.iscoroutinefunction(fn)
        self.isolation: Isolation = isolation or ("inline" if self.is_async else "thread")
        if self.isolation not in ("inline", "thread", "process"):
            raise ToolDefinitionError(f"tool {self.name}: isolation must be 'inline', 'thread' or 'process'")
        # A sync function runs inline only when its author says so (isolation="inline" given
        # explicitly): for trivial pure functions such as arithmetic, a thread hop costs more than
        # the call. It then blocks the event loop for its duration, and has no timeout.
        if self.isolation == "thread" and self.is_async:
            raise ToolDefinitionError(f"tool {self.name}: an async function runs inline or in a process")
        if self.isolation == "process" and "<locals>" in getattr(fn, "__qualname__", "<locals>"):
            raise ToolDefinitionError(f"tool {self.name}: isolation='process' needs a function defined at module "
                                      f"level (the sandbox imports it by name)")
        if memory_mb is not None and memory_mb < 1:
            raise ToolDefinitionError(f"tool {self.name}: memory_mb must be >= 1")
        self.memory_mb = memory_mb or DEFAULT_MEMORY_MB
        self.estimate_bytes = estimate_bytes
        self.limits = limits or ArgumentLimits()
        self._serialize = serialize or default_serialize
        self.args_model = self._build_args_model(fn, param_help)
        self._running_lock = threading.Lock()
        self._still_running = 0  # thread-isolated calls that timed out and have not ended yet

    @property
    def target(self) -> str:
        """``module:attribute`` by which the sandbox imports this tool (the module attribute may be
        the :class:`Tool` itself; the sandbox calls its ``.fn``)."""
        return f"{self.fn.__module__}:{self.fn.__qualname__}"

    @property
    def still_running(self) -> int:
        """Thread-isolated calls of this tool that timed out and have not ended yet."""
        return self._still_running

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
        # allow_inf_nan=False: "inf" and "NaN" strings that pydantic would coerce to floats are refused too
        config = ConfigDict(extra="forbid", allow_inf_nan=self.limits.allow_non_finite)
        model = create_model(f"{self.name}_args", __config__=config, **fields)
        return model

    # ------------------------------------------------------------------ schema

    @property
    def parameters(self) -> dict[str, Any]:
        """The arguments' JSON schema (read-only: computed once per argument model, because pydantic
        rebuilds it from scratch on every call, which cost more than a small tool's whole call)."""
        cached = self.__dict__.get("_parameters_cache")
        if cached is not None and cached[0] is self.args_model:
            return cached[1]
        schema = self.args_model.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        schema.setdefault("properties", {})
        self.__dict__["_parameters_cache"] = (self.args_model, schema)
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
        if isinstance(arguments, (bytes, bytearray)):
            arguments = bytes(arguments).decode("utf-8", "replace")
        if isinstance(arguments, str):
            arguments = _parse_arguments(arguments, self.limits, self.parameters)
        if not isinstance(arguments, dict):
            raise _ArgError("invalid_arguments", f"arguments must be a JSON object, got {type(arguments).__name__}")
        _check_tree(arguments, self.limits)
        try:
            parsed = self.args_model.model_validate(arguments)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors())
            raise _ArgError("invalid_arguments", f"invalid arguments for {self.name}: {problems}. "
                            f"Schema: {json.dumps(self.parameters)}") from None
        except (RecursionError, ValueError, TypeError, OverflowError) as e:  # a validator that raised oddly
            raise _ArgError("invalid_arguments", f"invalid arguments for {self.name}: {type(e).__name__}: "
                            f"{_short(e)}") from None
        return {k: getattr(parsed, k) for k in type(parsed).model_fields}

    def check_resources(self, kwargs: dict[str, Any]) -> None:
        """Refuse a validated call whose estimated working set exceeds this tool's memory ceiling."""
        if self.estimate_bytes is None:
            return
        try:
            need = float(self.estimate_bytes(**kwargs))
        except _ArgError:
            raise
        except (ValueError, TypeError, OverflowError, ArithmeticError) as e:
            raise _ArgError("invalid_arguments", f"invalid arguments for {self.name}: {_short(e)}") from None
        ceiling = self.memory_mb * 2**20
        if not need <= ceiling:  # NaN counts as too much
            raise _ArgError("resource_limit", f"{self.name} with these arguments would need about "
                            f"{_fmt_bytes(need)}, over its memory ceiling of {_fmt_bytes(ceiling)}; "
                            f"use smaller sizes")

    async def run(self, arguments: str | dict[str, Any] | None) -> ToolResult:
        """Validate, call with a timeout in the tool's isolation, serialise. Never raises (a
        cancellation of the caller passes through)."""
        start = time.perf_counter()

        def result(content: str, error: str | None = None, kind: str | None = None, value: Any = None) -> ToolResult:
            return ToolResult(self.name, content, error, kind, time.perf_counter() - start, value)

        def failure(kind: str, msg: str) -> ToolResult:
            return result(f"Error: {msg}", msg, kind)

        try:
            kwargs = self.validate(arguments)
            self.check_resources(kwargs)
        except _ArgError as e:
            return failure(e.kind, e.message)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # e.g. MemoryError while parsing: still the model's to fix
            return failure("invalid_arguments", f"arguments for {self.name} could not be checked: "
                           f"{type(e).__name__}: {_short(e)}")
        try:
            if self.isolation == "process":
                value = await self._call_in_process(kwargs)
            elif self.isolation == "thread":
                value = await self._call_in_thread(kwargs)
            elif not self.is_async:
                value = self.fn(**kwargs)
            else:
                coro = self.fn(**kwargs)
                value = await asyncio.wait_for(coro, self.timeout_s) if self.timeout_s else await coro
        except _CallFailed as e:
            return failure(e.kind, e.message)
        except asyncio.TimeoutError:
            return failure("timeout", f"tool {self.name} timed out after {self.timeout_s:g} s")
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the tool's own failure (SystemExit included): the run goes on
            return failure("exception", f"tool {self.name} raised {type(e).__name__}: {_short(e, 2000)}")
        try:
            content = self._serialize(value)
            if not isinstance(content, str):
                raise TypeError(f"the serializer returned {type(content).__name__}, not str")
        except ValueError as e:
            if "out of range float" in str(e).lower() or "nan" in str(e).lower():
                return failure("exception", f"tool {self.name} returned a non-finite number (NaN or infinity), "
                               f"which is not valid JSON")
            return failure("exception", f"tool {self.name} returned a value that cannot be serialised: {_short(e)}")
        except Exception as e:
            return failure("exception", f"tool {self.name} returned a value that cannot be serialised: "
                           f"{type(e).__name__}: {_short(e)}")
        return result(content, value=value)

    async def _call_in_thread(self, kwargs: dict[str, Any]) -> Any:
        """Run on a daemon worker thread. A timeout abandons the thread (it cannot be stopped) and
        counts it as still running until it ends; the pool other tools use is never touched."""
        with self._running_lock:
            if self._still_running >= MAX_STILL_RUNNING:
                raise _CallFailed("resource_limit", f"tool {self.name} is refused: {self._still_running} earlier "
                                  f"calls timed out and are still running; try again when they end")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        state = {"done": False, "abandoned": False}

        def deliver(ok: bool, payload: Any) -> None:
            if future.done():
                return
            if ok:
                future.set_result(payload)
            else:
                future.set_exception(payload)

        def work() -> None:
            try:
                value, ok = self.fn(**kwargs), True
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
                value, ok = e, False
            with self._running_lock:
                state["done"] = True
                if state["abandoned"]:
                    self._still_running -= 1
                    _GLOBAL.finished()
                    return
            try:
                loop.call_soon_threadsafe(deliver, ok, value)
            except RuntimeError:  # the loop closed meanwhile: nobody waits for the value
                pass

        ctx = contextvars.copy_context()  # as asyncio.to_thread: LangGraph's config and writers stay visible
        _POOL.submit(lambda: ctx.run(work))
        try:
            return await (asyncio.wait_for(asyncio.shield(future), self.timeout_s) if self.timeout_s else future)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            with self._running_lock:
                if not state["done"]:
                    state["abandoned"] = True
                    self._still_running += 1
                    _GLOBAL.abandoned()
            raise

    async def _call_in_process(self, kwargs: dict[str, Any]) -> Any:
        """Run in the sandbox: its own process group, rlimits, the tool's memory ceiling, a wall
        clock that kills the group. Arguments and the result travel as JSON."""
        from closedloop.sandbox import SandboxLimits, arun_sandboxed

        from closedloop.config import get_settings

        settings = get_settings()
        artifacts = settings.artifacts_dir.resolve()
        artifacts.mkdir(parents=True, exist_ok=True)
        from closedloop.paths import ROOTS_ENV, working_roots

        from closedloop.redact import is_sensitive_key
        from closedloop.tool_model_entries import MODELS_ENV, given_entries

        env = {k: v for k, v in os.environ.items()
               if (k.startswith("CLOSEDLOOP_") or k in _CHILD_ENV) and not is_sensitive_key(k)}
        env.update({"CLOSEDLOOP_ARTIFACTS": str(artifacts), "CLOSEDLOOP_HOME": str(settings.home.resolve()),
                    ROOTS_ENV: os.pathsep.join(str(r) for r in working_roots()),
                    MODELS_ENV: ",".join(given_entries())})  # --allow-model included; the child checks them
        wall = self.timeout_s or 24 * 3600.0
        limits = SandboxLimits(wall_s=wall, cpu_s=None, memory_mb=self.memory_mb, env=env,
                               writable_paths=[str(artifacts)], file_size_mb=1024)
        try:
            kwargs_json = json.loads(json.dumps(kwargs, default=_json_default, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise _CallFailed("invalid_arguments", f"arguments for {self.name} cannot be sent to its sandbox: "
                              f"{_short(e)}") from None
        res = await arun_sandboxed(self.target, limits=limits, cwd=os.getcwd(), **kwargs_json)
        if res.status == "ok":
            return res.value
        if res.status == "timeout":
            raise _CallFailed("timeout", f"tool {self.name} timed out after {self.timeout_s:g} s (its process "
                              f"was killed)")
        if res.status == "memory_exceeded":
            raise _CallFailed("resource_limit", f"tool {self.name} exceeded its memory ceiling of "
                              f"{self.memory_mb} MiB (its process was stopped); use smaller sizes")
        if res.status == "error":
            raise _CallFailed("exception", f"tool {self.name} raised {res.error_type}: "
                              f"{_short(res.error_message or '', 2000)}")
        raise _CallFailed("exception", f"tool {self.name} {res.error_message or res.status}")

    def with_options(self, **changes: Any) -> "Tool":
        """A copy of this tool with some of its options changed (``timeout_s=None``: a caller that
        wants the result however long it takes, e.g. a test on a loaded machine)."""
        options: dict[str, Any] = dict(name=self.name, description=self.description, timeout_s=self.timeout_s,
                                       mutates=self.mutates, serialize=self._serialize, isolation=self.isolation,
                                       memory_mb=self.memory_mb, estimate_bytes=self.estimate_bytes,
                                       limits=self.limits)
        return Tool(self.fn, **{**options, **changes})

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


ToolArgumentError = _ArgError  # public name: ``.kind`` ("malformed_json" | "invalid_arguments"), ``.message``


def parse_arguments(arguments: str | bytes | dict[str, Any] | None,
                    limits: ArgumentLimits | None = None) -> dict[str, Any]:
    """Arguments as a JSON object after the checks :meth:`Tool.run` applies before validation
    (size, depth, huge integers, NaN/Infinity), for callers with their own calling convention
    (e.g. a benchmark's toolkit). Raises :data:`ToolArgumentError` with a message for the model."""
    limits = limits or ArgumentLimits()
    if arguments is None or arguments == "":
        arguments = {}
    if isinstance(arguments, (bytes, bytearray)):
        arguments = bytes(arguments).decode("utf-8", "replace")
    if isinstance(arguments, str):
        arguments = _parse_arguments(arguments, limits, {"type": "object"})
    if not isinstance(arguments, dict):
        raise _ArgError("invalid_arguments", f"arguments must be a JSON object, got {type(arguments).__name__}")
    _check_tree(arguments, limits)
    return arguments


class _CallFailed(_ArgError):
    """A call that ran (or was refused to run) and failed in a way reported with its own kind."""


# Variables a sandboxed tool still sees besides CLOSEDLOOP_* (the sandbox scrubs the environment;
# no credentials: it has no network either).
_CHILD_ENV = ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class _StillRunning:
    """Process-wide count of thread-isolated calls that timed out and still run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def abandoned(self) -> None:
        with self._lock:
            self.count += 1

    def finished(self) -> None:
        with self._lock:
            self.count -= 1


_GLOBAL = _StillRunning()


class _DaemonPool:
    """Daemon worker threads for thread-isolated tools, reused while idle, one more whenever all
    are busy. Unlike an executor's fixed pool, a call that never returns costs one thread and
    never makes other calls wait; daemon threads never hold up interpreter exit (an executor's
    workers are joined at exit). Idle workers end after ``idle_s``."""

    def __init__(self, idle_s: float = 30.0) -> None:
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._idle_s = idle_s

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            q = self._idle.pop() if self._idle else None
        if q is None:
            q = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(q,), name="closedloop-tool", daemon=True).start()
        q.put(job)

    def _work(self, q: "queue.SimpleQueue[Callable[[], None]]") -> None:
        while True:
            try:
                job = q.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if q in self._idle:  # not handed a job meanwhile: retire
                        self._idle.remove(q)
                        return
                continue
            job()
            with self._lock:
                self._idle.append(q)


_POOL = _DaemonPool()


def still_running() -> int:
    """Thread-isolated tool calls (of any tool) that timed out and have not ended yet."""
    return _GLOBAL.count


def _short(e: BaseException | str, limit: int = 500) -> str:
    text = str(e)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def _fmt_bytes(n: float) -> str:
    if not math.isfinite(n):
        return "an unbounded amount of memory"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _reject_constant(token: str) -> Any:
    raise _ArgError("invalid_arguments", f"arguments contain {token}, which is not a JSON number; "
                    f"send finite numbers only")


# Built once: ``json.loads`` with a keyword builds a decoder (and its scanner) on every call.
_STRICT_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_LAX_DECODER = json.JSONDecoder()


def _parse_arguments(text: str, limits: ArgumentLimits, schema: dict[str, Any]) -> Any:
    """``json.loads`` that refuses oversized text, NaN/Infinity tokens, integers of thousands of
    digits and nesting deep enough to exhaust the parser's recursion, each with a clear message."""
    if len(text) > limits.max_bytes:
        raise _ArgError("invalid_arguments", f"arguments are {len(text)} characters of JSON, over the limit of "
                        f"{limits.max_bytes}; pass large arrays as .npy/.npz file paths")
    try:
        if text.startswith("\ufeff"):  # what json.loads refuses before decoding
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        return (_LAX_DECODER if limits.allow_non_finite else _STRICT_DECODER).decode(text)
    except _ArgError:
        raise
    except json.JSONDecodeError as e:
        raise _ArgError("malformed_json", f"arguments are not valid JSON ({e.msg} at position {e.pos}); "
                        f"send a JSON object matching the schema: {json.dumps(schema)}") from None
    except RecursionError:
        raise _ArgError("invalid_arguments", f"arguments are nested too deeply (limit {limits.max_depth} levels)") from None
    except ValueError as e:  # Python's int-size guard: "Exceeds the limit (4300 digits) ..."
        raise _ArgError("invalid_arguments", "arguments contain an integer with too many digits "
                        f"(at most about {int(limits.max_int_bits * 0.30103)} digits): {_short(e, 120)}") from None


def _check_tree(value: Any, limits: ArgumentLimits) -> None:
    """Walk parsed arguments (iteratively: no recursion to exhaust) for depth, size, huge
    integers and non-finite numbers."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    items = 0
    while stack:
        v, depth, where = stack.pop()
        items += 1
        if items > limits.max_items:
            raise _ArgError("invalid_arguments", f"arguments hold more than {limits.max_items} values; pass large "
                            f"arrays as .npy/.npz file paths")
        if isinstance(v, dict):
            if depth > limits.max_depth:
                raise _ArgError("invalid_arguments", f"arguments are nested too deeply (limit {limits.max_depth} levels)")
            stack.extend((x, depth + 1, f"{where}.{k}" if where else str(k)) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            if depth > limits.max_depth:
                raise _ArgError("invalid_arguments", f"arguments are nested too deeply (limit {limits.max_depth} levels)")
            stack.extend((x, depth + 1, f"{where}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        elif isinstance(v, int):
            if v.bit_length() > limits.max_int_bits:
                raise _ArgError("invalid_arguments", f"{where or 'arguments'}: integer too large "
                                f"(more than {limits.max_int_bits} bits)")
        elif isinstance(v, float):
            if not limits.allow_non_finite and not math.isfinite(v):
                what = "NaN" if math.isnan(v) else "infinity"
                raise _ArgError("invalid_arguments", f"{where or 'arguments'}: {what} is not allowed (NaN and "
                                f"infinities are not JSON numbers); send a finite number")


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
    return json.dumps(value, default=_json_default, allow_nan=False)  # NaN/Infinity are not JSON


def _json_default(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if hasattr(obj, "tolist"):  # numpy scalars / small arrays
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None,
         timeout_s: float | None = 60.0, mutates: bool = False, registry: "ToolRegistry | None" = None,
         isolation: Isolation | None = None, memory_mb: int | None = None,
         estimate_bytes: Callable[..., float] | None = None, limits: ArgumentLimits | None = None) -> Any:
    """Make a :class:`Tool` from a typed function: ``@tool`` or ``@tool(name=..., timeout_s=...)``.

    ``mutates=True`` marks a write tool (graders replay only those). ``registry`` registers it.
    ``isolation``, ``memory_mb``, ``estimate_bytes`` and ``limits``: see :class:`Tool`.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        t = Tool(f, name=name, description=description, timeout_s=timeout_s, mutates=mutates, isolation=isolation,
                 memory_mb=memory_mb, estimate_bytes=estimate_bytes, limits=limits)
        if registry is not None:
            registry.register(t)
        return t

    return wrap(fn) if fn is not None else wrap


@dataclass
class ToolRegistry:
    """Tools by name. Duplicate names are rejected; a missing name lists what exists."""

    tools: dict[str, Tool] = field(default_factory=dict)

    def register(self, t: Tool) -> Tool:
        if not isinstance(t, Tool):  # a LangChain tool is converted; anything else is a clear TypeError
            from closedloop.tool_functions import langchain_tool_keywords

            t = Tool(**langchain_tool_keywords(t))
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
            msg = f"unknown tool {_short(repr(call.name), 100)}; available tools: {sorted(self.tools)}"
            return ToolResult(call.name, f"Error: {msg}", msg, "unknown_tool")
        return await self.tools[call.name].run(call.function.arguments)

    async def call_json(self, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        return await self.call(ToolCall.make(name, arguments))
