"""Part ``model``: a Qwen2-0.5B-shaped model with random weights, built here (the device machine
reaches no model hub), for the training and serving parts.

The shape is Qwen2-0.5B's (hidden 896, MLP 4864, 24 layers, 14 query and 2 key/value heads,
vocabulary 151,936 rows, tied embeddings, RoPE theta 1e6, RMSNorm eps 1e-6), saved in bf16.
The tokenizer is the tiny model's (``closedloop.models.tiny.build_tokenizer``: Qwen2's pipeline,
its chat template and markup), trained here on the tiny model's synthetic conversations: it
covers the first few hundred ids; ids beyond it decode to nothing (tokenizers skips unknown ids),
so a random model's text is mostly empty while its token counts are real. Why random weights: the check
measures throughput and memory, which depend on the shape, not on what the weights say. A dry
run builds the same architecture at toy width (vocabulary 4,096).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from common import Recorder, part_main
from report import table

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 rope_theta=1_000_000.0)
TOY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=4096, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1_000_000.0)


def model_dir(work: Path) -> Path:
    """Where the training and serving parts find the model."""
    return work / "model"


def build(path: Path, shape: dict, device: str, seed: int = 0) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from closedloop.models.tiny import TinyConfig, build_tokenizer, synthetic_conversation

    rng = random.Random(seed)
    # the conversations as JSON text: enough to train the merges, and far cheaper than rendering
    # each through the chat template (the tiny model's build does that for its warm-up data)
    tok = build_tokenizer(TinyConfig(seed=seed), [json.dumps(synthetic_conversation(rng)[0]) for _ in range(600)])
    shape = dict(shape)
    rope_theta = shape.pop("rope_theta")
    config = Qwen2Config(**shape, tie_word_embeddings=True, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
                         rope_parameters={"rope_theta": rope_theta, "rope_type": "default"})
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = [config.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return {"parameters": sum(p.numel() for p in model.parameters()), "tokenizer_tokens": len(tok)}


def run(rec: Recorder, args: argparse.Namespace) -> str:
    import torch

    shape = TOY if args.dry_run else QWEN2_05B
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    info = build(model_dir(args.work), shape, device)
    info.update(shape="toy (dry run)" if args.dry_run else "Qwen2-0.5B", dims=shape, dtype="bfloat16",
                built_on=device, build_s=round(time.perf_counter() - t0, 2), path=str(model_dir(args.work)))
    rec.set("model", info)
    rec.summary(table(["model", "parameters", "layers x hidden", "vocabulary", "dtype", "built in"],
                      [[info["shape"], f"{info['parameters'] / 1e6:.1f} M",
                        f"{shape['num_hidden_layers']} x {shape['hidden_size']}", shape["vocab_size"], "bf16",
                        f"{info['build_s']} s on {device}"]]))
    return "ok"


if __name__ == "__main__":
    part_main("model", run)
