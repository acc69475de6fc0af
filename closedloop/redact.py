"""Keep credentials out of everything closedloop writes or prints: the run store, exports, logs.

A leaf module (standard library only), so any layer can import it without pulling in the store
(``closedloop.store`` re-exports ``redact``, ``redact_text`` and ``REDACTED`` for its users).

Two nets, because secrets arrive two ways: under a telling key (``{"api_key": ...}`` in a config)
and as bare strings (an ``sk-...`` key echoed in an exception, a ``Bearer`` header in a log line).
Key names are split into words, so ``hf_token`` and ``accessToken`` are caught while
``max_tokens``, ``prompt_tokens`` and ``tokenizer`` (counts and paths we need) are kept.

Message content and tool arguments get only the high-precision string patterns: they often hold
code, where ``token = tokens[i]`` must survive verbatim. Free text (errors) and configs also get
the ``key=value`` rule and bare 32-hex keys (messages keep those: checksums a model reads back).

The patterns: API-key shapes (``sk-`` of any length from 4 characters, ``hf_``, ``ghp_``, AWS, Slack,
Google), ``Bearer``/``Basic`` headers, JWTs, PEM blocks, URL userinfo (``http://user:key@host``) and
credential query parameters (``?api_key=``). Base64 media (``data:`` URLs, long base64 runs) is
skipped: random base64 holds key-like words the rules would otherwise mangle.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

__all__ = ["REDACTED", "is_sensitive_key", "env_secrets", "redact", "redact_text", "redact_arguments",
           "redact_message", "might_hold_secret", "redact_message_json", "redacted_message_json", "redact_spec"]

REDACTED = "[REDACTED]"

_SENSITIVE_WORDS = {"token", "secret", "password", "passwd", "authorization", "apikey", "credential", "credentials"}
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")

# Shapes of real credentials: OpenAI/Anthropic (short test keys too), bearer and basic headers, Hugging
# Face, GitHub, AWS, Slack, Google, JWTs. Each rule replaces the whole match.
_SECRET_PATTERNS = [
    re.compile(r"\bsk-[A-Za-z0-9][A-Za-z0-9_\-]{3,}"),
    re.compile(r"\b(?:Bearer|Basic|Token)\s+[A-Za-z0-9\-._~+/]{8,}=*"),
    re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"),
    re.compile(r"\bAIza[0-9A-Za-z\-_]{35}"),
    re.compile(r"\beyJ[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]*"),  # JWT: header.payload.signature
    # Userinfo in a URL: ``http://user:sk-...@host`` keeps scheme and host, loses user and password.
    # The userinfo ends at the authority's LAST ``@`` (as urllib splits it), so a password with an
    # unescaped ``@`` (``http://u:p@ss@host``) goes whole: the greedy run backtracks to that ``@``.
    re.compile(r"(?<=://)[^\s/?#\"'<>]+(?=@[^\s/?#@\"'<>]*)"),
]
# Header lines whose value is the credential, in free text and in pattern-only mode alike.
_HEADER = re.compile(r"(?i)\b((?:x-api-key|api-key|x-goog-api-key|x-auth-token)[\"']?\s?[:=]\s?[\"']?)([^\s\"',;&}]{4,})")
# A PEM block, whole; one cut off by truncation (no END line) is redacted to the end of the text.
_PEM = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----[\s\S]*?(?:-----END \1-----|\Z)")
# URL query parameters that carry credentials: ``?api_key=...``, ``&token=...``, ``&sig=...``.
_QUERY = re.compile(r"(?<=[?&])([A-Za-z0-9_.\-]+)=([^&#\s\"'<>]+)")
_QUERY_KEYS = {"key", "sig", "signature", "auth", "x-amz-signature", "x-amz-credential", "x-amz-security-token"}
# A bare 32-hex key (Mailgun, Datadog, many API keys). The hex form of a version-4 UUID (our run and
# thread ids) is kept: its 13th digit is 4 and its 17th one of 89ab. Longer hex runs (SHA-1/256) are
# not keys of this shape and stay.
_HEX32 = re.compile(r"(?<![A-Za-z0-9_\-])[0-9a-fA-F]{32}(?![A-Za-z0-9_\-])")
# Base64 media is never redacted: a data: URL, or a long bare base64 run (audio ``data`` fields).
# Random base64 holds key-like words ("...Token=...") that the rules would otherwise mangle.
_MEDIA = re.compile(r"data:[\w.+\-]+/[\w.+\-]+(?:;[\w.+\-]+=[\w.+\-]+)*;base64,[A-Za-z0-9+/]*={0,2}"
                    r"|(?<![A-Za-z0-9+/=_\-.])[A-Za-z0-9+/]{256,}={0,2}(?![A-Za-z0-9+/=_\-.])")
# ``password=hunter2``, ``"api_key": "abc"``, ``HF_TOKEN: xyz`` in free text.
# The value is a lookahead so that "failed: password=x" still finds "password" after "failed".
_KEY_VALUE = re.compile(r"""([A-Za-z_][\w\-]*)["']?\s*[=:]\s*["']?(?=([^\s"',;&}]+))""")
_MIN_ENV_SECRET = 8


# A superset of everything the rules above react to: each secret pattern's fixed prefix and each
# sensitive key word (``key`` stands for api_key, apiKey, x-api-key, access_key, ...), searched in
# the lower-cased text with plain substring tests (one case-insensitive regex alternation is ~10x
# slower). Text that holds none of them cannot be changed by any rule here, which lets the bulk
# writer skip the full, recursive, per-key redaction of the common message with no credential.
# Each costs a scan of the text, so none is implied by another (``auth`` covers authorization).
_TRIGGERS = ("sk-", "bearer", "basic", "hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "akia", "xox", "aiza", "token",
             "secret", "passw", "credential", "key", "eyj", "-----begin", "sig", "auth", "@")
_JSON_PLAIN = re.compile(r'^[^"\\\x00-\x1f\x7f-\U0010ffff]*$')
# Any 32-hex run, the cheap first test for a bare hex key (whose pattern's lookarounds make the
# regex engine try every position; this one lets it skip to a hex character).
_HEX_RUN = re.compile(r"[0-9a-f]{32}")


def might_hold_secret(text: str, env_secrets: list[str]) -> bool:
    """Conservative and fast: False only when no rule of this module could change ``text``, nor a
    JSON document whose serialised form is ``text`` (JSON escaping keeps every trigger intact; an
    environment secret with characters JSON would escape always answers True)."""
    lowered = text.lower()
    for trigger in _TRIGGERS:  # a loop, not any(generator): the generator costs more than most scans
        if trigger in lowered:
            return True
    if _HEX_RUN.search(lowered) is not None and _find_hex_key(text):
        return True
    for s in env_secrets:
        if s in text or not _json_plain(s):
            return True
    return False


@functools.lru_cache(maxsize=256)
def _json_plain(s: str) -> bool:
    """Whether JSON writes ``s`` as it is (no character it escapes)."""
    return _JSON_PLAIN.match(s) is not None


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


def env_secrets() -> list[str]:
    """Values of sensitive environment variables, so a key in a format we do not know is still caught."""
    values = {v for k, v in os.environ.items() if is_sensitive_key(k) and len(v) >= _MIN_ENV_SECRET}
    return sorted(values, key=len, reverse=True)


_env_secrets = env_secrets  # the name older imports use


def _find_hex_key(text: str) -> bool:
    return any(not _is_uuid4_hex(m.group(0)) for m in _HEX32.finditer(text))


def _is_uuid4_hex(h: str) -> bool:
    return h[12] == "4" and h[16] in "89abAB"


def _redact_hex(text: str) -> str:
    return _HEX32.sub(lambda m: m.group(0) if _is_uuid4_hex(m.group(0)) else REDACTED, text)


def _redact_query(text: str) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        return f"{name}={REDACTED}" if name.lower() in _QUERY_KEYS or is_sensitive_key(name) else m.group(0)

    return _QUERY.sub(sub, text)


def redact_text(text: str, *, key_values: bool = True, env_secrets: list[str] | None = None,
                hex_keys: bool = True) -> str:
    """Replace credential-shaped substrings; with ``key_values`` also values after sensitive keys.

    ``hex_keys=False`` keeps bare 32-hex strings (message content: checksums a model must read back).
    Base64 media (``data:`` URLs, long base64 runs) pass through untouched.
    """
    if not text:
        return text
    text = _PEM.sub(REDACTED, text) if "-----BEGIN " in text else text
    if len(text) < 256 or not _MEDIA.search(text):
        return _redact_plain(text, key_values, env_secrets, hex_keys)
    pieces, pos = [], 0
    for m in _MEDIA.finditer(text):
        pieces += [_redact_plain(text[pos:m.start()], key_values, env_secrets, hex_keys), m.group(0)]
        pos = m.end()
    return "".join(pieces) + _redact_plain(text[pos:], key_values, env_secrets, hex_keys)


def _redact_plain(text: str, key_values: bool, env_secrets: list[str] | None, hex_keys: bool) -> str:
    if not text:
        return text
    for secret in (env_secrets if env_secrets is not None else _env_secrets()):
        if secret in text:
            text = text.replace(secret, REDACTED)
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(REDACTED, text)
    text = _HEADER.sub(lambda m: m.group(1) + REDACTED, text)
    if "=" in text:
        text = _redact_query(text)
    if hex_keys:
        text = _redact_hex(text)
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


def redact_spec(spec: str | None) -> str | None:
    """A model spec (``openai:m@http://user:key@host/v1?api_key=...``) safe to store or print: URL
    userinfo and credential query parameters go, backend, model, host and path stay."""
    return None if spec is None else redact_text(str(spec))


def redact(value: Any, *, key_values: bool = True, keys: bool = True, env_secrets: list[str] | None = None,
           hex_keys: bool = True) -> Any:
    """A JSON-like value with credential-shaped strings replaced and, with ``keys``, the values of
    sensitive keys. Outcomes pass ``keys=False``: a reward named ``token_f1`` is a score, not a secret."""
    secrets = env_secrets if env_secrets is not None else _env_secrets()
    if isinstance(value, dict):
        return {k: (REDACTED if keys and value[k] is not None and is_sensitive_key(k)
                    else redact(value[k], key_values=key_values, keys=keys, env_secrets=secrets, hex_keys=hex_keys))
                for k in value}
    if isinstance(value, (list, tuple)):
        return [redact(v, key_values=key_values, keys=keys, env_secrets=secrets, hex_keys=hex_keys) for v in value]
    if isinstance(value, str):
        return redact_text(value, key_values=key_values, env_secrets=secrets, hex_keys=hex_keys)
    return value


def redact_arguments(arguments: str, env_secrets: list[str] | None = None) -> str:
    """Tool-call arguments as the model wrote them, unless a sensitive key or secret had to go.

    The raw string is kept byte-for-byte when nothing is redacted (malformed JSON included), so
    stored trajectories still show exactly what the model emitted. Never raises on hostile input:
    JSON that parses only past Python's limits (an integer of 5,000 digits, nesting deeper than
    the recursion limit) is redacted as text, with the ``key=value`` rule too, since its keys
    cannot be walked.
    """
    secrets = env_secrets if env_secrets is not None else _env_secrets()
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return redact_text(arguments, key_values=False, env_secrets=secrets, hex_keys=False)
    except TypeError:
        return redact_text(str(arguments), key_values=False, env_secrets=secrets, hex_keys=False)
    except (ValueError, RecursionError):  # int digit limit, nesting: valid JSON we cannot walk
        return redact_text(arguments, key_values=True, env_secrets=secrets, hex_keys=False)
    try:
        cleaned = redact(parsed, key_values=False, env_secrets=secrets, hex_keys=False)
        return arguments if cleaned == parsed else json.dumps(cleaned)
    except (ValueError, RecursionError):
        return redact_text(arguments, key_values=True, env_secrets=secrets, hex_keys=False)


def redact_message(message: dict[str, Any], env_secrets: list[str] | None = None) -> dict[str, Any]:
    """A dumped chat message: content by pattern, tool-call arguments by key as well."""
    secrets = env_secrets if env_secrets is not None else _env_secrets()
    out = redact(message, key_values=False, env_secrets=secrets, hex_keys=False)
    for call in out.get("tool_calls") or []:
        fn = call.get("function") or {}
        if isinstance(fn.get("arguments"), str):
            fn["arguments"] = redact_arguments(fn["arguments"], env_secrets=secrets)
    return out


def redact_message_json(message: dict[str, Any], env_secrets: list[str]) -> str:
    """``json.dumps(redact_message(message))``, without walking the message when its JSON text
    cannot hold anything to redact (see :func:`might_hold_secret`); the result is identical."""
    return redacted_message_json(message, env_secrets)[0]


def redacted_message_json(message: dict[str, Any], env_secrets: list[str]) -> tuple[str, bool]:
    """:func:`redact_message_json` and whether anything was redacted (the store then drops the
    token ids that still encode the removed text, see :mod:`closedloop.store.batch`)."""
    text = json.dumps(message)
    if not might_hold_secret(text, env_secrets):
        return text, False
    out = redact_message(message, env_secrets)
    return json.dumps(out, ensure_ascii=False), out != message
