"""Distributed data parallel: one SFT step on two gloo processes (``torchrun``, CPU) equals the
single-process step on the same global batch; GRPO runs on two processes and its replicas agree.

The single process sees the global batch of 4 as 2 accumulated micro-batches of 2; the two DDP
ranks see one micro-batch of 2 each. Both divide by the trained-token count of the whole global
batch, so the gradients agree up to float summation order. AdamW runs with ``adam_epsilon=1``,
which makes its first update ``lr·g/(|g|+1)``, a smooth function of the gradient (with the usual
tiny epsilon the first Adam step is ``lr·sign(g)``, which would hide a wrong gradient scale), and
without gradient clipping (which would normalise a wrong scale away too).

GRPO under DDP: each process collects its own rollouts (seeds of its own), so the processes can
have different numbers of rows, hence of micro-batches (``per_device_batch_size: 1``; an episode
gives one row per token view). The session runs all but the last under ``no_sync``, so each
process makes exactly one gradient all-reduce per optimizer step whatever its count (without it,
processes with different counts would pair up the wrong all-reduces); the replicas must end with
the same weights.

Run directly (``torchrun --standalone --nproc_per_node 2 tests/trainers/test_ddp.py OUT MODEL DATA``,
or ``... grpo OUT MODEL``) this file is the worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROWS = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in [
    ("What is 2 plus 3?", "It is 5."),
    ("Say hello to Mira, who built the lighthouse in 1907.", "Hello Mira!"),
    ("Thanks!", "You're welcome! Anything else I can do for you today?"),
    ("Multiply 4 by 6.", "24."),
]]


def overrides(out: Path, model: str, data: Path, per_device: int, accum: int) -> list[str]:
    return [f"model={model}", f"output_dir={out}", f"dataset={data}", "max_steps=1", "learning_rate=1.0",
            "adam_epsilon=1.0", "lr_scheduler=constant", f"per_device_batch_size={per_device}",
            f"gradient_accumulation_steps={accum}", "report_to=none", "save_steps=null", "torch_threads=1",
            "logging_steps=1", "max_grad_norm=null"]


def _worker(out: str, model: str, data: str) -> None:
    import torch
    from accelerate import PartialState

    from closedloop.trainers.config import SFTConfig, load_config
    from closedloop.trainers.sft import train_sft

    torch.set_num_threads(1)
    result = train_sft(load_config(SFTConfig, None, overrides(Path(out), model, Path(data), per_device=2, accum=1)))
    state = PartialState()
    if state.is_main_process:
        (Path(out) / "ddp.json").write_text(json.dumps({"world_size": state.num_processes,
                                                        "loss": result.metrics["loss"]}))


def _grpo_worker(out: str, model_path: str) -> None:
    import hashlib

    import torch
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from closedloop.trainers.grpo import GRPOConfig, train_grpo

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    cfg = GRPOConfig(model=model_path, output_dir=out, report_to=[], env="calc", env_options={"level": 1},
                     prompts_per_step=1, num_generations=2, max_steps=2, max_env_steps=2, max_new_tokens=16,
                     per_device_batch_size=1, learning_rate=1e-3, torch_threads=1, save_steps=None, seed=3)
    result = train_grpo(cfg, model=model, tokenizer=AutoTokenizer.from_pretrained(model_path))
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    rank = PartialState().process_index
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"digest": digest, "steps": result.steps,
                                                            "history": result.history}))


def _torchrun(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           __file__, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_grpo_on_two_gloo_processes_keeps_the_replicas_equal(tiny_model_path, tmp_path):
    import torch
    from safetensors.torch import load_file

    proc = _torchrun("grpo", str(tmp_path / "grpo"), str(tiny_model_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / "grpo" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["steps"] for r in ranks] == [2, 2]
    assert ranks[0]["digest"] == ranks[1]["digest"]  # one all-reduce per step kept the replicas identical
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    saved = load_file(str(tmp_path / "grpo" / "model.safetensors"))
    assert any(not torch.equal(saved[k], initial[k]) for k in initial)  # the steps trained


def test_two_gloo_processes_equal_one_process(tiny_model_path, tmp_path):
    import torch
    from safetensors.torch import load_file

    from closedloop.trainers.config import SFTConfig, load_config
    from closedloop.trainers.sft import train_sft

    torch.set_num_threads(1)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    proc = _torchrun(str(tmp_path / "ddp"), str(tiny_model_path), str(data), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((tmp_path / "ddp" / "ddp.json").read_text())
    assert info["world_size"] == 2

    single = train_sft(load_config(SFTConfig, None, overrides(tmp_path / "one", str(tiny_model_path), data,
                                                              per_device=2, accum=2)))
    assert abs(single.metrics["loss"] - info["loss"]) < 1e-5

    ddp, one = load_file(str(tmp_path / "ddp" / "model.safetensors")), load_file(str(tmp_path / "one" / "model.safetensors"))
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    moved = max((one[k] - initial[k]).abs().max().item() for k in one)
    assert moved > 1e-3  # the step changed the weights, so agreement below is not vacuous
    for k in one:
        torch.testing.assert_close(ddp[k], one[k], atol=1e-6, rtol=0, msg=k)


if __name__ == "__main__":
    if sys.argv[1] == "grpo":
        _grpo_worker(*sys.argv[2:4])
    else:
        _worker(*sys.argv[1:4])
