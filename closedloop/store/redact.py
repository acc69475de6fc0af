"""Keep credentials out of the run store.

Two nets, because secrets arrive two ways: under a telling key (``{"api_key": ...}`` in a config)
and as bare strings (an ``sk-...`` key echoed in an exception, a ``Bearer`` header in a log line).
Key names are split into words, so ``hf_token`` and ``accessToken`` are caught while
``max_tokens``, ``prompt_tokens`` and ``tokenizer`` (counts and paths we need) are kept.

Message content and tool arguments get only the high-precision string patterns: they often hold
code, where ``token = tokens[i]`` must survive verbatim. Free text (errors) and configs also get
the ``key=value`` rule.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

__all__ = ["REDACTED", "is_sensitive_key", "redact", "redact_text", "redact_arguments", "redact_message",
           "might_hold_secret", "redact_message_json"]

REDACTED = "[REDACTED]"

_SENSITIVE_WORDS = {"token", "secret", "password", "passwd", "authorization", "apikey", "credential", "credentials"}
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")

# Shapes of real credentials: OpenAI/Anthropic, bearer headers, Hugging Face, GitHub, AWS, Slack, Google.
_SECRET_PATTERNS = [
    re.compile(r"\bsk-[A-Za-z0-9][A-Za-z0-9_\-]{15,}"),
    re.compile(r"\bBearer\s+[A-Za-z0-9\-._~+/]{8,}=*"),
    re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"),
    re.compile(r"\bAIza[0-9A-Za-z\-_]{35}"),
]
# ``password=hunter2``, ``"api_key": "abc"``, ``HF_TOKEN: xyz`` in free text.
# The value is a lookahead so that "failed: password=x" still finds "password" after "failed".
_KEY_VALUE = re.compile(r"""([A-Za-z_][\w\-]*)["']?\s*[=:]\s*["']?(?=([^\s"',;&}]+))""")
_MIN_ENV_SECRET = 8


# A superset of everything the rules above react to: each secret pattern's fixed prefix and each
# sensitive key word (``key`` stands for api_key, apiKey, x-api-key, access_key, ...), searched in
# the lower-cased text with plain substring tests (one case-insensitive regex alternation is ~10x
# slower). Text that holds none of them cannot be changed by any rule here, which lets the bulk
# writer skip the full, recursive, per-key redaction of the common message with no credential.
_TRIGGERS = ("sk-", "bearer", "hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "akia", "xox", "aiza", "token", "secret",
             "passw", "authori", "credential", "key")
_JSON_PLAIN = re.compile(r'^[^"\\\x00-\x1f\x7f-\U0010ffff]*$')


def might_hold_secret(text: str, env_secrets: list[str]) -> bool:
    """Conservative and fast: False only when no rule of this module could change ``text``, nor a
    JSON document whose serialised form is ``text`` (JSON escaping keeps every trigger intact; an
    environment secret with characters JSON would escape always answers True)."""
    lowered = text.lower()
    if any(t in lowered for t in _TRIGGERS):
        return True
    return any(s in text or not _JSON_PLAIN.match(s) for s in env_secrets)


def is_sensitive_key(key: str) -> bool:
    """True for keys naming credentials: api_key, HF_TOKEN, client_secret, Authorization, ..."""
    return _is_sensitive_key(str(key))


@functools.lru_cache(maxsize=4096)
def _is_sensitive_key(key: str) -> bool:
    words = [w.lower() for w in _WORD_SPLIT.split(str(key)) if w]
    if any(w in _SENSITIVE_WORDS for w in words):
        return True
    joined = "".join(words)
    return "apikey" in joined or joined.endswith("secretkey") or joined.endswith("accesskey")


def _env_secrets() -> list[str]:
    """Values of sensitive environment variables, so a key in a format we do not know is still caught."""
    values = {v for k, v in os.environ.items() if is_sensitive_key(k) and len(v) >= _MIN_ENV_SECRET}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, *, key_values: bool = True, env_secrets: list[str] | None = None) -> str:
    """Replace credential-shaped substrings; with ``key_values`` also values after sensitive keys."""
    if not text:
        return text
    for secret in (env_secrets if env_secrets is not None else _env_secrets()):
        if secret in text:
            text = text.replace(secret, REDACTED)
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(REDACTED, text)
    if key_values:
        pieces, pos = [], 0
        for m in _KEY_VALUE.finditer(text):
            start = m.end()
            if start < pos or not is_sensitive_key(m.group(1)):
                continue
            pieces += [text[pos:start], REDACTED]
            pos = start + len(m.group(2))
        text = "".join(pieces) + text[pos:]
    return text


def redact(value: Any, *, key_values: bool = True, keys: bool = True, env_secrets: list[str] | None = None) -> Any:
    """A JSON-like value with credential-shaped strings replaced and, with ``keys``, the values of
    sensitive keys. Outcomes pass ``keys=False``: a reward named ``token_f1`` is a score, not a secret."""
    secrets = env_secrets if env_secrets is not None else _env_secrets()
    if isinstance(value, dict):
        return {k: (REDACTED if keys and value[k] is not None and is_sensitive_key(k)
                    else redact(value[k], key_values=key_values, keys=keys, env_secrets=secrets)) for k in value}
    if isinstance(value, (list, tuple)):
        return [redact(v, key_values=key_values, keys=keys, env_secrets=secrets) for v in value]
    if isinstance(value, str):
        return redact_text(value, key_values=key_values, env_secrets=secrets)
    return value


def redact_arguments(arguments: str, env_secrets: list[str] | None = None) -> str:
    """Tool-call arguments as the model wrote them, unless a sensitive key or secret had to go.

    The raw string is kept byte-for-byte when nothing is redacted (malformed JSON included), so
    stored trajectories still show exactly what the model emitted.
    """
    secrets = env_secrets if env_secrets is not None else _env_secrets()
    try:
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return redact_text(arguments, key_values=False, env_secrets=secrets)
    cleaned = redact(parsed, key_values=False, env_secrets=secrets)
    return arguments if cleaned == parsed else json.dumps(cleaned)


def redact_message(message: dict[str, Any], env_secrets: list[str] | None = None) -> dict[str, Any]:
    """A dumped chat message: content by pattern, tool-call arguments by key as well."""
    secrets = env_secrets if env_secrets is not None else _env_secrets()
    out = redact(message, key_values=False, env_secrets=secrets)
    for call in out.get("tool_calls") or []:
        fn = call.get("function") or {}
        if isinstance(fn.get("arguments"), str):
            fn["arguments"] = redact_arguments(fn["arguments"], env_secrets=secrets)
    return out


def redact_message_json(message: dict[str, Any], env_secrets: list[str]) -> str:
    """``json.dumps(redact_message(message))``, without walking the message when its JSON text
    cannot hold anything to redact (see :func:`might_hold_secret`); the result is identical."""
    text = json.dumps(message)
    if not might_hold_secret(text, env_secrets):
        return text
    return json.dumps(redact_message(message, env_secrets))
