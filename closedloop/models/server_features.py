"""What an OpenAI-compatible server accepts, learnt from its answers and remembered per base URL.

OpenAI-compatible servers differ in the optional fields they take: vLLM and ``closedloop serve``
take ``return_token_ids``; OpenAI rejects it with a 400; ``transformers serve`` rejects any field it
does not know with a 422 and silently ignores others (``logprobs``, ``tool_choice``). Asking a
server what it supports is not part of the API, so the ``openai:`` client sends what it would like,
reads which field a 400/422 answer names, resends once without it, and remembers the refusal here
(per base URL and model) so that every later client of the same server (the CLI's, every episode
of an evaluation) asks correctly the first time.

Servers name the field in different shapes; :func:`rejected_fields` reads the ones seen in the wild:
OpenAI (``{"error": {"message": "Unrecognized request argument supplied: return_token_ids",
"param": ...}}``), FastAPI/pydantic validation (``{"detail": [{"loc": ["body", "seed"], ...}]}``),
``transformers serve`` (``{"detail": "Unexpected fields in the request: {'return_token_ids'}"}``),
vLLM/SGLang (``{"object": "error", "message": "[{'type': 'extra_forbidden', 'loc': ('body', ...``).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

# Fields a request can do without: dropping one changes what comes back, not whether a reply does.
OPTIONAL_FIELDS = ("return_token_ids", "logprobs", "top_logprobs", "seed", "parallel_tool_calls", "tool_choice",
                   "stream_options")
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")


@dataclass
class ServerFeatures:
    """One server's refusals, for one model. ``rejected`` maps a feature key (a field name, or
    ``tool_choice=<form>`` since servers take some forms and not others) to the server's words."""

    url: str
    model: str = ""
    rejected: dict[str, str] = field(default_factory=dict)
    ignores_token_ids: bool = False  # asked, answered without them: it never will send them
    returns_token_ids: bool = False
    max_tokens_field: str | None = None  # the name this server takes, once one was refused


_REGISTRY: dict[tuple[str, str], ServerFeatures] = {}
_LOCK = threading.Lock()


def server_features(url: str, model: str = "") -> ServerFeatures:
    """The (shared, mutable) record for ``model`` on the server at ``url``. Kept per model as well
    as per URL because one server may treat models differently (OpenAI refuses ``logprobs`` for
    its reasoning models only)."""
    key = (url.rstrip("/"), model)
    with _LOCK:
        if key not in _REGISTRY:
            _REGISTRY[key] = ServerFeatures(*key)
        return _REGISTRY[key]


def forget_server_features(url: str | None = None) -> None:
    """Forget what was learnt about one server (all its models), or about all servers: after a
    server was upgraded or replaced."""
    with _LOCK:
        for key in [k for k in _REGISTRY if url is None or k[0] == url.rstrip("/")]:
            del _REGISTRY[key]


def tool_choice_key(tool_choice: Any) -> str:
    """``tool_choice=auto|none|required`` or ``tool_choice=function`` for a named function."""
    return f"tool_choice={tool_choice if isinstance(tool_choice, str) else 'function'}"


def error_text(body: Any, fallback: str) -> str:
    """The human part of an error answer, whatever its shape."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]:
            return err["message"]
        if isinstance(err, str) and err:
            return err
        if body.get("detail") is not None:
            return str(body["detail"])
    if isinstance(body, str) and body:
        return body
    return fallback


# Words a server uses when it refuses a field outright (rather than, say, its value being too large).
REFUSAL_HINTS = ("unrecognized", "unknown", "unexpected", "not supported", "unsupported", "extra", "not permitted",
                 "not allowed", "does not support", "forbidden", "invalid parameter")


def names_other_max_tokens_field(sent: str, text: str) -> str | None:
    """The other max-tokens name when the server refused ``sent`` and points at the other one
    (OpenAI's "Unsupported parameter: 'max_tokens' ... Use 'max_completion_tokens' instead")."""
    other = MAX_TOKENS_FIELDS[1 - MAX_TOKENS_FIELDS.index(sent)]
    low = text.lower()
    if _named(sent, text) and _named(other, text) and any(h in low for h in REFUSAL_HINTS) \
            and "too large" not in low:
        return other
    return None


def _named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text) is not None


def rejected_fields(body: Any, message: str, sent: Iterable[str]) -> list[str]:
    """The fields among ``sent`` that a 400/422 answer (``body`` as parsed JSON, ``message`` the
    SDK's text) names. Structured hints (``param``, a validation error's ``loc``) are read first;
    otherwise the field must appear as a whole word in the error message (``top_logprobs`` does
    not name ``logprobs``). A caller confirms the guess by resending: a field wrongly blamed is
    not remembered, because the resend then fails the same way."""
    sent = list(sent)
    found: list[str] = []

    def add(name: Any) -> None:
        if isinstance(name, str) and name in sent and name not in found:
            found.append(name)

    texts = [message]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            add(err.get("param"))
            texts.append(str(err.get("message") or ""))
        elif isinstance(err, str):
            texts.append(err)
        detail = body.get("detail")
        if isinstance(detail, list):
            for item in detail:
                for part in (item.get("loc") or []) if isinstance(item, dict) else []:
                    add(part)
        elif detail is not None:
            texts.append(str(detail))
        if isinstance(body.get("message"), str):
            texts.append(body["message"])
    elif isinstance(body, str):
        texts.append(body)
    if not found:
        text = "\n".join(texts)
        for name in sent:
            if _named(name, text):
                add(name)
    return found
