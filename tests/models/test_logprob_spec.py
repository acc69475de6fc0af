"""What each local backend says its logprobs are (``Turn.logprob_spec``): the ``vllm:`` mapping from
vLLM's ``logprobs_mode`` runs without vLLM; the comparison with a recomputation needs a GPU."""

from __future__ import annotations

import importlib.util

import pytest

from closedloop.messages import LogprobSpec, UserMessage
from closedloop.models.base import ModelError, SamplingParams
from closedloop.models.hf import hf_logprob_spec
from closedloop.models.vllm_client import vllm_logprob_spec


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=0, top_p=0.3),
                                    SamplingParams(temperature=1.3, top_p=1.0)])
def test_hf_and_vllm_agree_when_top_p_is_one_or_greedy(params):
    hf, vllm = hf_logprob_spec(params), vllm_logprob_spec("processed_logprobs", params)
    assert vllm.mode == hf.mode == "tempered"
    assert (vllm.temperature, vllm.top_p) == (hf.temperature, hf.top_p)
    assert vllm.backend == "vllm" and hf.backend == "hf"


def test_vllm_records_processed_when_top_p_truncates():
    spec = vllm_logprob_spec("processed_logprobs", SamplingParams(temperature=0.7, top_p=0.9))
    assert spec == LogprobSpec(mode="processed", temperature=0.7, top_p=0.9, backend="vllm")
    assert not spec.comparable_to_tempered()
    assert hf_logprob_spec(SamplingParams(temperature=0.7, top_p=0.9)).comparable_to_tempered()


def test_old_vllm_raw_logprobs_are_tempered_only_at_temperature_one_or_greedy():
    assert vllm_logprob_spec("raw_logprobs", SamplingParams(temperature=0.7)).mode == "raw"
    assert vllm_logprob_spec("raw_logprobs", SamplingParams(temperature=1.0)).mode == "tempered"
    assert vllm_logprob_spec("raw_logprobs", SamplingParams(temperature=0.0)).mode == "tempered"
    with pytest.raises(ModelError, match="processed_logprobs"):
        vllm_logprob_spec("raw_logits", SamplingParams())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
async def test_vllm_logprobs_equal_the_tempered_recomputation(tiny_model_path, tools):
    """GPU only: vLLM's recorded logprobs at temperature 0.7, top_p 1 equal an hf forward pass's
    log_softmax(logits / 0.7); at top_p 0.9 they are marked processed."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs CUDA")
    from transformers import AutoModelForCausalLM

    from closedloop.models.vllm_client import VLLMClient

    client = VLLMClient(str(tiny_model_path), max_model_len=1024, gpu_memory_utilization=0.2, enforce_eager=True,
                        dtype="float32")
    msgs = [UserMessage(content="What is 3 plus 4?")]
    turn = await client.generate(msgs, [tools["add"]], SamplingParams(temperature=0.7, seed=3, max_tokens=40))
    assert turn.logprob_spec == LogprobSpec(mode="tempered", temperature=0.7, top_p=1.0, backend="vllm")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([turn.prompt_ids + turn.completion_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(turn.prompt_ids) - 1:-1] / 0.7, -1)
    expected = logp.gather(1, torch.tensor(turn.completion_ids)[:, None])[:, 0].tolist()
    assert max(abs(a - b) for a, b in zip(turn.logprobs, expected)) < 1e-3
    cut = await client.generate(msgs, [tools["add"]], SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=8))
    assert cut.logprob_spec.mode == "processed"
    await client.aclose()
