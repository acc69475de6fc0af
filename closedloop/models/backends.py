"""The built-in model backends: ``openai``, ``hf`` and ``vllm`` (entry points of ``closedloop.backends``).

Each turns a parsed :class:`~closedloop.models.ModelSpec` into a client and imports its client
module only when called, so naming a backend costs nothing until a model is made. A package adds a
backend (the ``<name>:`` of a model spec) with a function of the same shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from closedloop.models import ModelClient, ModelSpec


def openai(spec: ModelSpec, **kwargs: Any) -> ModelClient:
    """OpenAI, or any OpenAI-compatible server given as ``openai:<model>@<base_url>``."""
    from closedloop.models.openai_client import OpenAIClient

    return OpenAIClient(spec.model, base_url=spec.base_url, **kwargs)


def hf(spec: ModelSpec, **kwargs: Any) -> ModelClient:
    """A local transformers checkpoint; a vision-language one gets its processor-aware client."""
    from closedloop.models.hf_vision import HFVisionClient, is_vision_checkpoint
    from closedloop.models.locate import locate_checkpoint

    locate_checkpoint(spec.model)  # a missing local path fails here, in one line, not after hub retries
    if is_vision_checkpoint(spec.model):  # a VLM: prompts through its processor
        return HFVisionClient.from_pretrained(spec.model, **kwargs)
    from closedloop.models.hf import HFClient

    return HFClient.from_pretrained(spec.model, **kwargs)


def vllm(spec: ModelSpec, **kwargs: Any) -> ModelClient:
    """vLLM's offline engine (GPU; the ``vllm`` extra)."""
    import importlib.util

    from closedloop.models.locate import locate_checkpoint
    from closedloop.models.vllm_client import VLLMClient

    if importlib.util.find_spec("vllm") is not None:  # without vLLM its install hint comes first
        locate_checkpoint(spec.model)
    return VLLMClient(spec.model, **kwargs)
