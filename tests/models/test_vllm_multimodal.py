"""What ``vllm:`` sends vLLM for a multimodal prompt: one placeholder per part in the prompt ids and
the decoded media in ``multi_modal_data`` (vLLM's own processor expands them), and the turn keeps
the media's content addresses. vLLM needs a GPU, so the engine is a stand-in with vLLM's
``LLM.generate`` interface that records its requests; the tokenizer, processor and media decoding
are the real ones (the tiny VLM's and the tiny audio model's)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import types

import numpy as np
import pytest

from closedloop.messages import AudioPart, ImagePart, TextPart, UserMessage
from closedloop.models import UnsupportedInputError
from closedloop.models.base import SamplingParams


class FakeLLM:
    """vLLM's ``LLM`` as the client uses it: ``get_tokenizer``, ``generate(prompts, sampling_params)``."""

    requests: list = []

    def __init__(self, model, **kwargs):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model)

    def get_tokenizer(self):
        return self.tok

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        FakeLLM.requests.extend(prompts)
        eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        done = types.SimpleNamespace(token_ids=[eos], logprobs=None, finish_reason="stop")
        return [types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=[done]) for p in prompts]


@pytest.fixture()
def fake_vllm(monkeypatch):
    import closedloop.models.vllm_client as vc

    fake = types.SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setattr(vc, "_import_vllm", lambda: fake)
    FakeLLM.requests = []
    return vc


def png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(0).random((30, 30, 3)) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def test_images_go_as_multi_modal_data(fake_vllm, tiny_vlm_path):
    client = fake_vllm.VLLMClient(str(tiny_vlm_path))
    data = png()
    turn = asyncio.run(client.generate([UserMessage(content=[TextPart(text="What is it? "), ImagePart.from_bytes(data)])],
                                       params=SamplingParams(temperature=0, max_tokens=4)))
    [req] = FakeLLM.requests
    image_id = client.tokenizer.convert_tokens_to_ids("<image>")
    assert req["prompt_token_ids"].count(image_id) == 1  # unexpanded: vLLM's processor expands it
    [img] = req["multi_modal_data"]["image"]
    assert img.size == (30, 30)
    assert [r.sha256 for r in turn.media] == [hashlib.sha256(data).hexdigest()]
    text_only = asyncio.run(client.generate([UserMessage(content="hi")], params=SamplingParams(max_tokens=2)))
    assert "multi_modal_data" not in FakeLLM.requests[-1] and text_only.media == []


def test_audio_goes_as_arrays_and_text_models_refuse_media(fake_vllm, tiny_model_path, tmp_path):
    import wave

    from closedloop.models.tiny_vlm import build_tiny_audio_lm

    alm = build_tiny_audio_lm(tmp_path / "alm", tiny_model_path)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8_000)
        w.writeframes((np.sin(np.arange(8000) * 0.1) * 9000).astype("<i2").tobytes())
    client = fake_vllm.VLLMClient(str(alm))
    asyncio.run(client.generate([UserMessage(content=[AudioPart.from_bytes(buf.getvalue(), "wav")])],
                                params=SamplingParams(max_tokens=2)))
    [(audio, rate)] = FakeLLM.requests[-1]["multi_modal_data"]["audio"]
    assert rate == 16_000 and abs(len(audio) - 16_000) < 400  # 1 s resampled from 8 kHz
    text = fake_vllm.VLLMClient(str(tiny_model_path))
    with pytest.raises(UnsupportedInputError, match="text-only model"):
        asyncio.run(text.generate([UserMessage(content=[ImagePart.from_bytes(png())])]))
