"""Reading a request body without trusting it: refused with 413 once it is known to be too large,
408 when it does not arrive whole, and 400 for every way its JSON can be hostile (too deep, lone
surrogates, non-finite numbers, ``NaN``); after a large body, freed memory goes back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import math
import re
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from closedloop.server.api_error import APIError

#: Deepest JSON nesting a request may have (OpenAI bodies need a handful; tool schemas a few more).
MAX_JSON_DEPTH = 64
# As \uD800-\uDFFF escapes, or as raw bytes (json.loads decodes bytes with "surrogatepass").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def check_json(body: Any, raw: bytes) -> None:
    """Raise :class:`APIError` 400 for what ``json.loads`` accepts but a request must not hold:
    nesting deeper than :data:`MAX_JSON_DEPTH`, lone UTF-16 surrogates (they cannot be encoded, so
    they would fail deep inside a backend), non-finite numbers (``1e400`` parses to infinity)."""
    check_strings = _SURROGATE_ESCAPE.search(raw) is not None  # neither escapes nor bytes: no surrogate anywhere
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise APIError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep "
                                    f"(at {path or 'top'})", param=path or None, code="invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                if check_strings and isinstance(k, str) and _SURROGATE.search(k):
                    raise APIError(400, f"a key at {path or 'top'} holds a lone UTF-16 surrogate, which is not "
                                        "valid Unicode", param=path or None, code="invalid_value")
                if isinstance(v, (dict, list, str, float)):
                    stack.append((v, depth + 1, f"{path}.{k}" if path else str(k)))
        elif isinstance(value, str):
            if check_strings and _SURROGATE.search(value):
                raise APIError(400, f"{path or 'body'} holds a lone UTF-16 surrogate, which is not valid Unicode",
                               param=path or None, code="invalid_value")
        elif isinstance(value, float) and not math.isfinite(value):
            raise APIError(400, f"{path or 'body'} is a number out of range", param=path or None, code="invalid_value")


def parse_json(raw: bytes) -> Any:
    """The body as JSON; every way it can be malformed is an :class:`APIError` 400."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep",
                       code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer of more than 4300 digits
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    check_json(body, raw)
    return body


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    def too_large(size: str) -> APIError:
        return APIError(413, f"request body is {size}; this server accepts at most {limit} bytes "
                             "(closedloop serve --max-request-bytes)", code="request_too_large")

    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise too_large(f"{int(declared)} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"over {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or closed by the body read timeout (closedloop.server.connections)
        raise APIError(408, "the request body did not arrive whole", code="request_timeout") from None
    return b"".join(chunks)


def release_memory() -> None:
    """Give freed heap back to the OS after a large request: collect the reference cycles that an
    error's traceback makes around a big prompt's token list, then ``malloc_trim`` (glibc keeps freed
    heap otherwise, which looks like a leak of hundreds of MB per big body). Without ``malloc_trim``
    (not glibc) only the collection runs."""
    global _malloc_trim
    gc.collect()
    if _malloc_trim is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _malloc_trim = libc.malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None
