"""Values as the store keeps them: plain JSON text, redacted labels, error text, new run ids.

Everything a caller hands the store (a config as a pydantic model or dataclass, a tag, a graph
name, an exception) passes through here on its way to a row, so credentials never reach the file
(:mod:`closedloop.redact`) and text DuckDB cannot hold never fails a write
(:func:`~closedloop.store.batch.storable`).
"""

from __future__ import annotations

import dataclasses
import json
import traceback
import uuid
from typing import Any, Mapping, Sequence

from pydantic import BaseModel

from closedloop.redact import might_hold_secret, redact, redact_text
from closedloop.store.batch import storable

__all__ = ["jsonable", "dumps", "loads", "redacted_json", "format_error", "redacted_label", "redacted_tags", "new_id"]

_MAX_ERROR_CHARS = 20_000


def jsonable(value: Any) -> Any:
    """Configs arrive as pydantic models, dataclasses or dicts; the store keeps plain JSON."""
    if value is None:
        return None
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif isinstance(value, Mapping):
        value = dict(value)
    try:
        return json.loads(json.dumps(value, default=str))
    except (ValueError, RecursionError) as e:  # an int past Python's digit limit, nesting past the recursion limit
        raise ValueError(f"cannot store this value as JSON: {type(e).__name__}: {str(e)[:200]}") from None


def dumps(value: Any) -> str | None:
    return None if value is None else storable(json.dumps(value, ensure_ascii=False))


def loads(value: Any) -> Any:
    """A JSON column as read back (DuckDB gives JSON as text) to Python values."""
    return json.loads(value) if isinstance(value, str) else value


def redacted_json(value: Any, secrets: list[str], *, keys: bool = True, key_values: bool = True) -> str:
    """``dumps(redact(jsonable(value), ...))`` with one serialisation when the JSON text cannot
    hold anything to redact (:func:`~closedloop.redact.might_hold_secret`), the usual case."""
    if not isinstance(value, dict):
        value = jsonable(value)
    text = storable(json.dumps(value, default=str, ensure_ascii=False))
    if not might_hold_secret(text, secrets):
        return text
    return dumps(redact(json.loads(text), keys=keys, key_values=key_values, env_secrets=secrets)) or "null"


def format_error(error: BaseException | str | None) -> str | None:
    """An error as the ``runs.error`` column keeps it: the traceback's last 20,000 characters, redacted."""
    if error is None:
        return None
    if isinstance(error, BaseException):
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip()
        text = text or repr(error)
    else:
        text = str(error)
    return redact_text(text[-_MAX_ERROR_CHARS:])


def redacted_label(value: str | None, secrets: list[str] | None = None) -> str | None:
    """A short label (graph name, tag, metric name) as stored: credential shapes go, as everywhere else."""
    return None if value is None else storable(redact_text(str(value), env_secrets=secrets))


def redacted_tags(tags: Sequence[str] | None, secrets: list[str]) -> list[str]:
    if isinstance(tags, str):
        raise TypeError("tags must be a list of strings, not one string")
    return [label for t in tags or [] if (label := redacted_label(t, secrets)) is not None]


def new_id() -> str:
    return uuid.uuid4().hex
