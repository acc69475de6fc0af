import importlib.util

import pytest

from closedloop.messages import UserMessage
from closedloop.models.base import ModelError, SamplingParams


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_missing_vllm_gives_an_install_hint():
    from closedloop.models import make_client

    with pytest.raises(ModelError, match=r"pip install closedloop\[vllm\]"):
        make_client("vllm:/nowhere")


async def test_vllm_turn_is_token_exact(tiny_model_path, tools):
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs CUDA")
    from closedloop.models.vllm_client import VLLMClient

    client = VLLMClient(str(tiny_model_path), max_model_len=1024, gpu_memory_utilization=0.2, enforce_eager=True)
    msgs = [UserMessage(content="What is 3 plus 4?")]
    turn = await client.generate(msgs, [tools["add"]], SamplingParams(temperature=0, max_tokens=48))
    assert turn.prompt_ids == client.encode_prompt(msgs, [tools["add"]])
    assert client.decode(turn.completion_ids) == turn.completion_text
    assert len(turn.logprobs) == len(turn.completion_ids)
    assert turn.message.tool_calls and turn.message.tool_calls[0].name == "add"
    seeded = SamplingParams(temperature=1.0, seed=4, max_tokens=30)
    a, b = await client.generate_many(msgs, [tools["add"]], seeded, n=2)
    c, _ = await client.generate_many(msgs, [tools["add"]], seeded, n=2)
    assert a.completion_ids == c.completion_ids
    await client.aclose()
