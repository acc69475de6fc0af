"""Checkpointers that round-trip our pydantic types.

LangGraph's serializer revives only allow-listed classes; anything else comes back as a dict
(langgraph#7066), is revived with a "will be blocked in a future version" warning, or, under
``LANGGRAPH_STRICT_MSGPACK``, is blocked. We list our state types explicitly instead of turning the
allowlist off, in two places: the serializer of the savers we make (:func:`serializer`), and
LangGraph's process-wide set of safe msgpack types (:func:`register_state_types`, run on import of
:mod:`closedloop.runtime`), so a saver we did not configure (``InMemorySaver()``, the one
``langgraph dev`` brings) revives them too. The second reaches into
``langgraph.checkpoint.serde._msgpack.SAFE_MSGPACK_TYPES``, which LangGraph consults on every
revival; LangGraph has no public registration hook yet, and a test fails if that set moves.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

if TYPE_CHECKING:  # imported where it is used: aiosqlite only for a sqlite checkpointer
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

STATE_TYPES = [
    ("closedloop.messages", "SystemMessage"),
    ("closedloop.messages", "UserMessage"),
    ("closedloop.messages", "AssistantMessage"),
    ("closedloop.messages", "ToolMessage"),
    ("closedloop.messages", "Turn"),
    ("closedloop.messages", "Usage"),
    ("closedloop.runtime.state", "ToolRecord"),
]


def register_state_types(extra: list[tuple[str, str]] | None = None) -> None:
    """Add our state types (plus ``extra``) to LangGraph's safe msgpack types, for every checkpointer.

    Each entry names one class by module and name (no prefixes), so nothing else is widened.
    """
    from langgraph.checkpoint.serde import _msgpack

    wanted = frozenset(STATE_TYPES) | frozenset(extra or [])
    if not wanted <= _msgpack.SAFE_MSGPACK_TYPES:
        _msgpack.SAFE_MSGPACK_TYPES = _msgpack.SAFE_MSGPACK_TYPES | wanted


class _RedactingSerializer(JsonPlusSerializer):
    """LangGraph writes a failed task's exception into the checkpoint (its ``__error__`` write, stored
    as the exception's repr). Error texts carry what the failing call was given: a model server's
    URL with its ``user:key@`` userinfo, a header, a key echoed back. That text is redacted by the run
    store's rules before it is written; nothing else is changed (state is revived as it was saved)."""

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        if isinstance(obj, BaseException):
            from closedloop.redact import redact_text

            return super().dumps_typed(redact_text(repr(obj)))
        return super().dumps_typed(obj)


def serializer(extra: list[tuple[str, str]] | None = None) -> JsonPlusSerializer:
    """A serializer that revives our state types (plus ``extra`` (module, class) pairs) and redacts
    the errors it writes."""
    return _RedactingSerializer(allowed_msgpack_modules=STATE_TYPES + list(extra or []))


def make_checkpointer(kind: Literal["memory", "sqlite"] = "memory", path: str | Path | None = None,
                      extra_types: list[tuple[str, str]] | None = None):
    """An in-memory saver, or an async SQLite saver on ``path``.

    The SQLite saver is returned as an async context manager (it owns a connection):
    ``async with make_checkpointer("sqlite", p) as saver: graph = build(..., checkpointer=saver)``.
    """
    serde = serializer(extra_types)
    if kind == "memory":
        return InMemorySaver(serde=serde)
    if kind == "sqlite":
        if path is None:
            raise ValueError("the sqlite checkpointer needs a path")
        return _SqliteContext(str(path), serde)
    raise ValueError(f"unknown checkpointer {kind!r}; use 'memory' or 'sqlite'")


class _SqliteContext:
    def __init__(self, path: str, serde: JsonPlusSerializer) -> None:
        self.path, self.serde = path, serde
        self._cm: AbstractAsyncContextManager[AsyncSqliteSaver] | None = None

    async def __aenter__(self) -> AsyncSqliteSaver:
        from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._cm = AsyncSqliteSaver.from_conn_string(self.path)
        saver = await self._cm.__aenter__()
        saver.serde = self.serde
        return saver

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        if self._cm is None:
            raise RuntimeError("the sqlite checkpointer was exited without being entered")
        return await self._cm.__aexit__(exc_type, exc, tb)
