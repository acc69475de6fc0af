"""Model clients chosen by one spec string, shared by the CLI and configs.

=================================  ==========================================================
``openai:<model>``                 OpenAI (or ``OPENAI_BASE_URL``) through the ``openai`` package
``openai:<model>@<base_url>``      any OpenAI-compatible server: vLLM, SGLang, ``closedloop serve``
``hf:<path-or-id>``                a local transformers model, micro-batched, token-exact
``vllm:<path-or-id>``              vLLM's offline engine (GPU; needs the ``vllm`` extra)
=================================  ==========================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from closedloop.models.base import (ContextLengthExceededError, GenerateRequest, ModelClient, ModelError,
                                    ModelUnavailableError, UnsupportedInputError,
                                    SamplingParams, StreamEvent, TextDelta, ToolChoice, TurnDone)

__all__ = ["ModelClient", "SamplingParams", "ModelError", "ModelUnavailableError", "ContextLengthExceededError",
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
        from closedloop.store.redact import redact_spec

        return redact_spec(f"{self.backend}:{self.model}" + (f"@{self.base_url}" if self.base_url else "")) or ""


BACKENDS = ("openai", "hf", "vllm")


def parse_spec(spec: str) -> ModelSpec:
    """``backend:model[@base_url]``; the URL part is only meaningful for ``openai``."""
    from closedloop.store.redact import redact_spec

    backend, sep, rest = spec.partition(":")
    if not sep or backend not in BACKENDS or not rest:  # errors show the spec redacted: it may hold a key
        raise ValueError(f"model spec {redact_spec(spec)!r} must look like one of: openai:<model>[@<base_url>], "
                         f"hf:<path-or-id>, vllm:<path-or-id>")
    base_url = None
    if backend == "openai" and "@" in rest:
        rest, base_url = rest.split("@", 1)
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL {redact_spec(base_url)!r} in {redact_spec(spec)!r} must start with http:// "
                             f"or https://")
    return ModelSpec(backend, rest, base_url)


def make_client(spec: str | ModelSpec, **kwargs) -> ModelClient:
    """Build the client a spec names. Backend modules are imported here, only when used."""
    s = parse_spec(spec) if isinstance(spec, str) else spec
    if s.backend == "openai":
        from closedloop.models.openai_client import OpenAIClient

        return OpenAIClient(s.model, base_url=s.base_url, **kwargs)
    if s.backend == "hf":
        from closedloop.models.hf_vision import HFVisionClient, is_vision_checkpoint

        if is_vision_checkpoint(s.model):  # a VLM: prompts through its processor
            return HFVisionClient.from_pretrained(s.model, **kwargs)
        from closedloop.models.hf import HFClient

        return HFClient.from_pretrained(s.model, **kwargs)
    from closedloop.models.vllm_client import VLLMClient

    return VLLMClient(s.model, **kwargs)
