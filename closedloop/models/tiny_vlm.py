"""A tiny vision-language model built offline: a real LLaVA architecture at toy size.

Why LLaVA: its processor (``LlavaProcessor``: a CLIP image processor plus the tokenizer) needs
neither torchvision nor the hub, so a checkpoint built here loads with the same
``AutoProcessor`` / ``AutoModelForImageTextToText`` calls a real VLM checkpoint does, and the
``hf:`` backend's multimodal path is exercised exactly as with a real model (Qwen2-VL's processor
cannot be constructed without torchvision, which has no CPU build for the pinned torch here).

The language half is the tiny text model of :mod:`closedloop.models.tiny` (its weights copied, one
``<image>`` token appended to the vocabulary), so on a text-only conversation the VLM reads the
same prompt ids and computes the same logits (its softmax has one more entry): a test checks that,
and that an image changes the output.
The vision tower (CLIP, one layer) and projector are random: this model exists to test mechanics,
not to see.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from closedloop.models.tiny import token_id

IMAGE_TOKEN = "<image>"
AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
TINY_VLM_FILE = "closedloop_tiny_vlm.json"

# The text template with list content rendered part by part: text as is, an image as <image>
# (which the processor expands to one token per patch). String content renders as before, so a
# text-only conversation gives the same tokens as the text model's template.
_CONTENT = ("{%- macro render(content) -%}{%- if content is string -%}{{- content -}}"
            "{%- elif content is none -%}{%- else -%}{%- for part in content -%}"
            "{%- if part.type == 'text' -%}{{- part.text -}}"
            "{%- elif part.type == 'image' or part.type == 'image_url' -%}{{- '" + IMAGE_TOKEN + "' -}}"
            "{%- elif part.type == 'audio' or part.type == 'input_audio' -%}{{- '" + "".join(AUDIO_TOKENS) + "' -}}"
            "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}")


def vlm_chat_template(text_template: str) -> str:
    """The tiny text model's template with multimodal user content."""
    if "(message.content or '')" not in text_template:
        raise ValueError("unexpected text chat template: cannot add image rendering")
    return _CONTENT + text_template.replace("(message.content or '')", "render(message.content)")


def build_tiny_vlm(path: str | Path, text_model: str | Path, *, seed: int = 0, image_size: int = 28,
                   patch_size: int = 14) -> Path:
    """Build the tiny VLM into ``path`` from the tiny text checkpoint ``text_model``.

    ``image_size`` / ``patch_size`` set how many image tokens a picture costs:
    ``(image_size // patch_size) ** 2`` (4 by default).
    """
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig,
                              LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor)

    if image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
    t0 = time.perf_counter()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(text_model))
    text = AutoModelForCausalLM.from_pretrained(str(text_model), dtype=torch.float32)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    template = vlm_chat_template(tokenizer.chat_template)
    tokenizer.chat_template = template

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=image_size, patch_size=patch_size)
    config = LlavaConfig(vision_config=vision, text_config=_text_config(text, tokenizer),
                         image_token_index=token_id(tokenizer, IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    model = LlavaForConditionalGeneration(config).eval()
    _copy_text_weights(model, text)
    model.generation_config.eos_token_id = text.generation_config.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy="default", chat_template=template,
                               image_token=IMAGE_TOKEN, num_additional_image_tokens=1)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _portable(path)
    record: dict[str, Any] = {"text_model": Path(text_model).name, "seed": seed, "image_size": image_size,
                              "patch_size": patch_size, "image_tokens": (image_size // patch_size) ** 2,
                              "n_parameters": sum(p.numel() for p in model.parameters()),
                              "vocab_size": len(tokenizer), "build_seconds": round(time.perf_counter() - t0, 2),
                              "torch": torch.__version__}
    (path / TINY_VLM_FILE).write_text(json.dumps(record, indent=2))
    return path


def _text_config(text: Any, tokenizer: Any) -> dict[str, Any]:
    """The text model's config for the language half: the grown vocabulary, untied embeddings
    (multimodal wrappers resize embeddings and head separately; copying both keeps the text
    behaviour exact whatever the text checkpoint's tying)."""
    cfg = text.config.to_dict()
    cfg["vocab_size"] = len(tokenizer)
    cfg["tie_word_embeddings"] = False
    for key in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        cfg.pop(key, None)
    return cfg


def _copy_text_weights(model: Any, text: Any) -> None:
    """The text model's weights into ``model.model.language_model`` and ``lm_head``; the new
    tokens get the mean input embedding and a zero output row."""
    import torch

    with torch.no_grad():
        old_vocab = text.config.vocab_size
        emb_in = text.get_input_embeddings().weight
        lm = model.get_input_embeddings().weight
        lm[:old_vocab] = emb_in
        lm[old_vocab:] = emb_in.mean(0, keepdim=True)
        head = model.get_output_embeddings().weight
        head[:old_vocab] = text.get_output_embeddings().weight
        head[old_vocab:] = 0.0
        src = {k: v for k, v in text.model.state_dict().items() if not k.startswith("embed_tokens")}
        missing = model.model.language_model.load_state_dict(src, strict=False)
        bad = [k for k in missing.missing_keys if not k.startswith("embed_tokens")]
        if bad or missing.unexpected_keys:
            raise RuntimeError(f"text weights do not fit: missing {bad}, unexpected {missing.unexpected_keys}")


def _portable(path: Path) -> None:
    cfg_file = path / "tokenizer_config.json"  # loadable by transformers 4.x too, as the text model
    tok_cfg = json.loads(cfg_file.read_text())
    tok_cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_file.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))


def build_tiny_audio_lm(path: str | Path, text_model: str | Path, *, seed: int = 0) -> Path:
    """A tiny audio-language model (Qwen2-Audio architecture: a one-layer Whisper-style encoder, a
    projector, the tiny text LM's weights) with its real ``Qwen2AudioProcessor``; audio parts
    render as ``<|audio_bos|><|AUDIO|><|audio_eos|>``."""
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, Qwen2AudioConfig,
                              Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor, WhisperFeatureExtractor)

    t0 = time.perf_counter()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(text_model))
    text = AutoModelForCausalLM.from_pretrained(str(text_model), dtype=torch.float32)
    tokenizer.add_special_tokens({"additional_special_tokens": list(AUDIO_TOKENS)})
    template = vlm_chat_template(tokenizer.chat_template)
    tokenizer.chat_template = template
    torch.manual_seed(seed)
    config = Qwen2AudioConfig(audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2,
                                                encoder_ffn_dim=64, d_model=32, max_source_positions=1500),
                              text_config={**_text_config(text, tokenizer), "model_type": "qwen2"},
                              audio_token_index=token_id(tokenizer, "<|AUDIO|>"))
    model = Qwen2AudioForConditionalGeneration(config).eval()
    _copy_text_weights(model, text)
    model.generation_config.eos_token_id = text.generation_config.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tokenizer,
                                    chat_template=template)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _portable(path)
    (path / TINY_VLM_FILE).write_text(json.dumps({"text_model": Path(text_model).name, "seed": seed, "kind": "audio",
                                                  "n_parameters": sum(p.numel() for p in model.parameters()),
                                                  "build_seconds": round(time.perf_counter() - t0, 2)}, indent=2))
    return path
