"""Media in prompts for local backends: decode image/audio parts, address them by content, and
render a conversation in the form multimodal processors' chat templates take.

Why content addresses: a multimodal prompt's token ids alone do not determine what the model saw
(the pixels go in beside the ids), so a turn records a :class:`~closedloop.messages.MediaRef` per
image or audio part (sha256 of the bytes, in prompt order); with the messages it rebuilds the
exact model input for training, and two turns over the same picture share one reference.

Local backends never fetch a URL: an ``http(s)`` image is the caller's to download (the same
rule as audio, see :meth:`AudioPart.from_url`), so a run is reproducible from its record.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any

from closedloop.messages import (AudioPart, ImagePart, MediaRef, SystemMessage, TextPart, ToolMessage, UserMessage,
                                 _Message)
from closedloop.models.base import UnsupportedInputError
from closedloop.models.chat_format import message_to_template_dict


class MediaError(UnsupportedInputError):
    """A media part that cannot be read (bad data URL, remote URL, undecodable image)."""


def has_media(messages: list[_Message]) -> bool:
    """Whether any message carries an image or audio part."""
    return any(isinstance(p, (ImagePart, AudioPart)) for m in messages
               if isinstance(m.content, list) for p in m.content)


def media_kinds(messages: list[_Message]) -> set[str]:
    return {("image" if isinstance(p, ImagePart) else "audio") for m in messages
            if isinstance(m.content, list) for p in m.content
            if isinstance(p, (ImagePart, AudioPart))}


def require_text_only(messages: list[_Message], model_name: str) -> None:
    """A text-only model given an image or audio part: a clear error, never a silent drop."""
    kinds = media_kinds(messages)
    if kinds:
        raise UnsupportedInputError(f"{model_name} is a text-only model and cannot read {' or '.join(sorted(kinds))} parts; "
                         f"use a vision/audio-language checkpoint (hf: loads one through its processor) "
                         f"or remove the parts")


def part_bytes(part: ImagePart | AudioPart) -> tuple[bytes, str]:
    """The raw bytes of a part and its MIME type."""
    if isinstance(part, AudioPart):
        try:
            return base64.b64decode(part.input_audio.data, validate=True), f"audio/{part.input_audio.format}"
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"input_audio data is not valid base64: {e}") from None
    url = part.image_url.url
    if url.startswith("data:"):
        header, _, data = url.partition(",")
        if ";base64" not in header:
            raise MediaError("image data URLs must be base64-encoded (data:<mime>;base64,...)")
        try:
            return base64.b64decode(data, validate=True), header[5:].split(";", 1)[0] or "application/octet-stream"
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"image data URL is not valid base64: {e}") from None
    raise MediaError(f"local models do not fetch image URLs ({url[:60]!r}); pass the image as bytes or a path "
                     f"(ImagePart.from_path / from_bytes), which become data URLs")


def media_refs(messages: list[_Message]) -> list[MediaRef]:
    """One reference per image/audio part, in prompt order."""
    refs: list[MediaRef] = []
    for mi, m in enumerate(messages):
        content = getattr(m, "content", None)
        if not isinstance(content, list):
            continue
        for pi, p in enumerate(content):
            if isinstance(p, (ImagePart, AudioPart)):
                data, mime = part_bytes(p)
                refs.append(MediaRef(kind="image" if isinstance(p, ImagePart) else "audio",
                                     sha256=hashlib.sha256(data).hexdigest(), mime=mime, size=len(data),
                                     message=mi, part=pi))
    return refs


def load_image(part: ImagePart) -> Any:
    """A PIL image (RGB) from an image part."""
    from PIL import Image, UnidentifiedImageError

    data, _ = part_bytes(part)
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise MediaError(f"image part could not be decoded: {e}") from None
    return img.convert("RGB")


def render_for_processor(messages: list[_Message]) -> tuple[list[dict[str, Any]], list[Any], list[AudioPart]]:
    """Template dicts in the processor convention (``{"type": "image"}`` placeholders, images in
    order beside), plus the images (PIL) and audio parts, in prompt order.

    Text-only messages render exactly as for a text model, so a VLM whose language half is a text
    model's sees the same tokens on a conversation without media.
    """
    rendered: list[dict[str, Any]] = []
    images: list[Any] = []
    audio: list[AudioPart] = []
    for m in messages:
        content = getattr(m, "content", None)
        if not isinstance(content, list) or not any(isinstance(p, (ImagePart, AudioPart)) for p in content):
            rendered.append(message_to_template_dict(m))
            continue
        if not isinstance(m, (UserMessage, SystemMessage, ToolMessage)):
            raise MediaError(f"{type(m).__name__} cannot carry media parts")
        parts: list[dict[str, Any]] = []
        for p in content:
            if isinstance(p, TextPart):
                parts.append({"type": "text", "text": p.text})
            elif isinstance(p, ImagePart):
                images.append(load_image(p))
                parts.append({"type": "image"})
            else:
                audio.append(p)
                parts.append({"type": "audio"})
        d: dict[str, Any] = {"role": m.role, "content": parts}
        if isinstance(m, ToolMessage):
            d["tool_call_id"] = m.tool_call_id
        rendered.append(d)
    return rendered, images, audio


__all__ = ["MediaError", "has_media", "media_kinds", "require_text_only", "part_bytes", "media_refs", "load_image",
           "render_for_processor"]
