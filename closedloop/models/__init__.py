"""Model clients chosen by one spec string, shared by the CLI and configs.

=================================  ==========================================================
``openai:<model>``                 OpenAI (or ``OPENAI_BASE_URL``) through the ``openai`` package
``openai:<model>@<base_url>``      any OpenAI-compatible server: vLLM, SGLang, ``closedloop serve``
``hf:<path-or-id>``                a local transformers model, micro-batched, token-exact
``vllm:<path-or-id>``              vLLM's offline engine (GPU; needs the ``vllm`` extra)
=================================  ==========================================================

Backends are plugins (entry points of ``closedloop.backends``, :mod:`closedloop.models.backends`
for the built-in ones), so a package adds ``<name>:<model>`` specs without editing this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from closedloop.models.base import (ContextLengthExceededError, GenerateRequest, ModelClient, ModelError,
                                    ModelUnavailableError, UnsupportedInputError,
                                    SamplingParams, StreamEvent, TextDelta, ToolChoice, TurnDone)

from closedloop.models.locate import CheckpointNotFoundError

__all__ = ["CheckpointNotFoundError", "ModelClient", "SamplingParams", "ModelError", "ModelUnavailableError", "ContextLengthExceededError",
           "UnsupportedInputError",
           "GenerateRequest",
           "StreamEvent", "TextDelta", "TurnDone", "ToolChoice", "ModelSpec", "parse_spec", "make_client"]


@dataclass(frozen=True)
class ModelSpec:
    backend: str
    model: str
    base_url: str | None = None

    def __str__(self) -> str:
        """The spec as printed and logged: credentials in the URL (``user:key@``, ``?api_key=``) redacted."""
        from closedloop.redact import redact_spec

        return redact_spec(f"{self.backend}:{self.model}" + (f"@{self.base_url}" if self.base_url else "")) or ""


BACKENDS_GROUP = "closedloop.backends"
# How each built-in backend's spec is written, for error messages; other backends are "<name>:<model>".
_SPEC_FORMS = {"openai": "openai:<model>[@<base_url>]", "hf": "hf:<path-or-id>", "vllm": "vllm:<path-or-id>"}


def parse_spec(spec: str) -> ModelSpec:
    """``backend:model[@base_url]``; the backend is a plugin of ``closedloop.backends`` (built in:
    ``openai``, ``hf``, ``vllm``); the URL part is only meaningful for ``openai``."""
    from closedloop.plugins import registry
    from closedloop.redact import redact_spec

    backend, sep, rest = spec.partition(":")
    known = registry(BACKENDS_GROUP)
    backends = known.names()
    if not sep or backend not in backends or not rest:  # errors show the spec redacted: it may hold a key
        forms = [form for name, form in _SPEC_FORMS.items() if name in backends]
        forms += [f"{name}:<model>" for name in backends if name not in _SPEC_FORMS]
        raise ValueError(f"model spec {redact_spec(spec)!r} must look like one of: {', '.join(forms)}"
                         if forms else f"model spec {redact_spec(spec)!r}: {known.missing_hint()}")
    base_url = None
    if backend == "openai" and "@" in rest:
        rest, base_url = rest.split("@", 1)
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL {redact_spec(base_url)!r} in {redact_spec(spec)!r} must start with http:// "
                             f"or https://")
    return ModelSpec(backend, rest, base_url)


def make_client(spec: str | ModelSpec, **kwargs: Any) -> ModelClient:
    """Build the client a spec names, through its backend plugin (which imports its client module
    only now)."""
    from closedloop.plugins import load

    s = parse_spec(spec) if isinstance(spec, str) else spec
    client: ModelClient = load(BACKENDS_GROUP, s.backend)(s, **kwargs)
    return client
