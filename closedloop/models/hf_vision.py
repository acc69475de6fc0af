"""``hf:`` for vision-language checkpoints: the same batched sampler, prompts built by the processor.

A VLM checkpoint (one with a processor and an ``AutoModelForImageTextToText`` class) differs from a
text model in one place only: the prompt. The processor renders the chat template, expands each
image placeholder to the model's image tokens and computes ``pixel_values``; decoding after the
first forward pass is the text model's. So this client overrides the two hooks of
:class:`~closedloop.models.hf.HFClient` (encode a request; extra inputs of the prefill) and
inherits everything else: micro-batching, seeded per-row sampling, tempered logprobs, streaming,
tool-call parsing, the weights lock.

Audio-language checkpoints (Qwen2-Audio and the like, loaded with ``AutoModelForMultimodalLM``)
go the same way: audio parts are decoded with PyAV to 16 kHz and given to the processor's feature
extractor. Each turn records the exact prompt ids (media tokens expanded) and a
:class:`~closedloop.messages.MediaRef` per part, so the model input can be rebuilt exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from closedloop.messages import MediaRef, MessageBase
from closedloop.models.base import ModelError, ToolChoice
from closedloop.models.chat_format import encode_rendered, select_tools
from closedloop.models.hf import HFClient, _Request, _Row
from closedloop.models.multimodal import MediaError, media_refs, render_for_processor

__all__ = ["HFVisionClient", "is_vision_checkpoint"]


def is_vision_checkpoint(path: str | Path) -> bool:
    """Whether a local checkpoint is a multimodal (image- or audio-) language model with a processor."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return False
    has_processor = any((path / f).is_file() for f in ("processor_config.json", "preprocessor_config.json"))
    if not has_processor:
        return False
    cfg = json.loads((path / "config.json").read_text())
    return "vision_config" in cfg or "audio_config" in cfg


class HFVisionClient(HFClient):
    """A transformers VLM (``AutoModelForImageTextToText`` + ``AutoProcessor``) behind the model interface."""

    def __init__(self, model: Any, processor: Any, *, name: str = "", max_batch_size: int = 16,
                 batch_wait_ms: float = 5.0, batch_gap_ms: float | None = None, prompt_cache_tokens: int = 0):
        self.processor = processor
        tokenizer = processor.tokenizer
        if getattr(tokenizer, "chat_template", None) is None and getattr(processor, "chat_template", None):
            tokenizer.chat_template = processor.chat_template
        # The prompt cache keys states by token ids alone, so it only ever serves text-only prompts
        # (rows with media or processor extras are always prefilled; see HFClient._prefill).
        super().__init__(model, tokenizer, name=name, max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms,
                         batch_gap_ms=batch_gap_ms, prompt_cache_tokens=prompt_cache_tokens)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: Any = "auto", max_batch_size: int = 16,
                        batch_wait_ms: float = 5.0, prompt_cache_tokens: int = 0,
                        **model_kwargs: Any) -> "HFVisionClient":
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        if isinstance(dtype, str) and dtype != "auto":
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16' or 'auto'")
            dtype = getattr(torch, dtype)
        processor = AutoProcessor.from_pretrained(str(path))
        try:
            model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=dtype, **model_kwargs)
        except ValueError:  # an audio-language model (Qwen2-Audio ...): the generic multimodal class
            from transformers import AutoModelForMultimodalLM

            model = AutoModelForMultimodalLM.from_pretrained(str(path), dtype=dtype, **model_kwargs)
        model = model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to): typeshed's _Wrapped binds no self
        model.eval()
        return cls(model, processor, name=str(path), max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms,
                   prompt_cache_tokens=prompt_cache_tokens)

    # ------------------------------------------------------------------ the two hooks

    def encode_multimodal(self, messages: list[MessageBase], tools: list[dict[str, Any]] | None = None,
                          tool_choice: ToolChoice | None = None) -> tuple[list[int], dict[str, Any] | None]:
        """Prompt ids (image placeholders expanded) and the processor's other tensors."""
        rendered, images, audio = render_for_processor(messages)
        reads_audio = hasattr(self.processor, "feature_extractor")
        reads_images = hasattr(self.processor, "image_processor")
        if audio and not reads_audio:
            raise MediaError(f"{self.spec} reads images, not audio parts")
        if images and not reads_images:
            raise MediaError(f"{self.spec} reads audio, not image parts")
        shown = select_tools(tools, tool_choice)
        template = getattr(self.processor, "chat_template", None)
        # Content is text, never control tokens (issue 9): the prompt ids come from the escaping
        # encoder, with one placeholder per media part, which the processor's expansion replaces.
        safe = encode_rendered(self.tokenizer, rendered, shown, chat_template=template)
        if not images and not audio:
            return safe, None
        text = self.processor.apply_chat_template(rendered, tools=shown, tokenize=False, add_generation_prompt=True)
        kwargs: dict[str, Any] = {}
        if images:
            kwargs["images"] = images
        if audio:
            from closedloop.models.asr import SAMPLE_RATE, load_audio
            from closedloop.models.multimodal import part_bytes

            kwargs["audio"] = [load_audio(part_bytes(a)[0]) for a in audio]
            kwargs["sampling_rate"] = SAMPLE_RATE
        enc = self.processor(text=[text], return_tensors="pt", add_special_tokens=False, **kwargs)
        expanded = enc.pop("input_ids")[0].tolist()
        enc.pop("attention_mask", None)
        return self._splice_media(safe, expanded), dict(enc)

    def _media_token_ids(self) -> set[int]:
        ids = set()
        for attr in ("image_token", "audio_token", "video_token"):
            tok = getattr(self.processor, attr, None)
            if isinstance(tok, str):
                i = self.tokenizer.convert_tokens_to_ids(tok)
                if isinstance(i, int) and i != self.tokenizer.unk_token_id:
                    ids.add(i)
        return ids

    def _splice_media(self, safe: list[int], expanded: list[int]) -> list[int]:
        """``safe`` (escaped content, one placeholder per media part) with each placeholder replaced
        by the run of media tokens the processor expanded it to in ``expanded``. When the two agree
        outside media (no control strings in the content) this is exactly ``expanded``; a processor
        whose expansion is not a run of its placeholder token is refused rather than guessed."""
        media = self._media_token_ids()
        runs: list[list[int]] = []
        for i, t in enumerate(expanded):
            if t in media:
                if i > 0 and expanded[i - 1] == t and runs:
                    runs[-1].append(t)
                else:
                    runs.append([t])
        slots = [i for i, t in enumerate(safe) if t in media]
        if len(slots) != len(runs) or any(safe[i] != r[0] for i, r in zip(slots, runs)):
            if safe == [t for i, t in enumerate(expanded) if t not in media or i == 0 or expanded[i - 1] != t]:
                return expanded
            raise MediaError(f"{self.spec}: the processor's media expansion is not a run of its placeholder "
                             f"token, so content with control-token text cannot be escaped safely")
        out: list[int] = []
        prev = 0
        for i, run in zip(slots, runs):
            out += safe[prev:i] + run
            prev = i + 1
        return out + safe[prev:]

    def _encode_request(self, req: _Request) -> tuple[list[int], dict[str, Any] | None, list[MediaRef]]:
        ids, extras = self.encode_multimodal(req.messages, req.tools, req.tool_choice)
        return ids, extras, media_refs(req.messages)

    #: Vision-language models may derive more than attention from the 2D mask (e.g. rope indices).
    _step_mask_4d = False

    def _prefill_inputs(self, rows: list[_Row], device: Any) -> dict[str, Any]:
        """Per-row tensors concatenated in row order: the model matches image features to image
        tokens in flattened (row-major) order, which is the order of the rows."""
        import torch

        with_media = [r.extras for r in rows if r.extras]
        if not with_media:
            return {}
        keys = set(with_media[0])
        if any(set(e) != keys for e in with_media):
            raise ModelError("requests in one batch produced different processor outputs")
        return {k: torch.cat([e[k] for e in with_media], 0).to(device) for k in sorted(keys)}
