import hashlib
import json

import pytest

from closedloop.models.tiny import TINY_CONFIG_FILE, build_tiny_model


def test_checkpoint_reloads_with_auto_classes_and_template_renders_tools(tiny_model_path, tools):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    messages = [{"role": "user", "content": "What is 3 plus 4?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]},
                {"role": "tool", "content": "7"}]
    text = tok.apply_chat_template(messages, tools=[tools["add"]], add_generation_prompt=True, tokenize=False)
    assert "<tools>\n" + json.dumps(tools["add"]) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Markup tokens are atomic, and survive decoding even when special tokens are skipped.
    for marker in ("<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker
    ids = tok.encode("<tool_call>x</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>x</tool_call>"
    out = model(input_ids=torch.tensor([tok.encode(text)]))
    assert out.logits.shape[-1] >= len(tok)


def test_build_record_shows_warm_up_learned(tiny_model_path):
    record = json.loads((tiny_model_path / TINY_CONFIG_FILE).read_text())
    assert record["config"]["seed"] == 0
    assert record["final_loss"] < record["initial_loss"] / 5


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes() + (path / "tokenizer.json").read_bytes()).hexdigest()


def test_build_is_deterministic_under_seed_and_rejects_bad_settings(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3, train_steps=3, n_conversations=60, hidden_size=32,
                         intermediate_size=64)
    b = build_tiny_model(tmp_path / "b", seed=3, train_steps=3, n_conversations=60, hidden_size=32,
                         intermediate_size=64)
    c = build_tiny_model(tmp_path / "c", seed=4, train_steps=3, n_conversations=60, hidden_size=32,
                         intermediate_size=64)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)
    with pytest.raises(ValueError, match="unknown"):
        build_tiny_model(tmp_path / "d", hidden=3)
