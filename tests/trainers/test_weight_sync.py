"""Weight sync: GRPO with rollouts from a ``closedloop serve`` process pushes its weights there after
every update, so the server ends up serving exactly the trained model; the admin endpoint is off
unless asked for and refuses bad directories whole. The vLLM path runs only with CUDA and vLLM.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from closedloop.messages import UserMessage
from closedloop.models.base import SamplingParams
from closedloop.server.local import free_port, serve_app, serve_subprocess
from closedloop.trainers.grpo import GRPOConfig, train_grpo
from closedloop.trainers.weight_sync import (ClosedloopServerSync, InProcessSync, LiveSync, make_weight_sync,
                                             named_weights, server_root)

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
PROMPT = "What is 3 plus 4?"


@pytest.fixture(scope="module")
def weight_server(tiny_model_path) -> Iterator[str]:
    with serve_subprocess(f"hf:{tiny_model_path}", "--torch-threads", "1", "--allow-weight-updates", env=ENV,
                          cwd=REPO) as url:
        yield url


def _served_greedy(url: str) -> tuple[list[int], list[float]]:
    r = httpx.post(f"{url}/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 24,
        "logprobs": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]


def _local_greedy(client) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=0, max_tokens=24)
    turn = asyncio.run(client.generate([UserMessage(content=PROMPT)], None, params))
    return turn.completion_ids, turn.logprobs


def _load(url: str, path: Any, **extra: Any) -> httpx.Response:
    return httpx.post(server_root(url) + "/closedloop/v1/load_weights", json={"path": str(path), **extra}, timeout=60)


def test_grpo_pushes_each_update_and_the_server_ends_serving_the_trained_model(weight_server, tiny_model_path,
                                                                               tmp_path):
    from closedloop.models.hf import HFClient

    base = _served_greedy(weight_server)
    pushed: list[int] = []

    def on_step(step: int, metrics: dict[str, float]) -> None:  # after the step's push
        status = httpx.get(server_root(weight_server) + "/closedloop/v1/weights", timeout=10).json()
        pushed.append(status["step"])

    out = tmp_path / "out"
    cfg = GRPOConfig(model=str(tiny_model_path), output_dir=str(out), env="calc", env_options={"level": 1},
                     rollout_model=f"openai:tiny@{weight_server}", prompts_per_step=2, num_generations=2, max_steps=2,
                     max_env_steps=2, max_new_tokens=24, learning_rate=1e-3, per_device_batch_size=4, seed=3,
                     torch_threads=1, report_to="none",
                     # completion length varies between samples: every group has advantages, so weights move
                     reward_funcs=["closedloop.trainers.rewards:completion_tokens"],
                     reward_weights={"completion_tokens": -0.01})
    result = train_grpo(cfg, on_step=on_step)
    assert result.steps == 2

    final = HFClient.from_pretrained(out)
    start = HFClient.from_pretrained(tiny_model_path)
    changed = any(not torch.equal(start.model.state_dict()[k], v) for k, v in final.model.state_dict().items())
    assert changed, "training did not move the weights; raise the learning rate"
    ids, lps = _served_greedy(weight_server)
    want_ids, want_lps = _local_greedy(final)
    assert ids == want_ids
    assert lps == pytest.approx(want_lps, abs=1e-6)
    assert ids != base[0] or lps != pytest.approx(base[1], abs=1e-4), "the server still answers as the initial model"
    assert pushed == [1, 2], "the server got the weights of every step before the next rollouts"
    assert not (out / "weight_sync").exists(), "the sync directory is removed at the end"


def test_the_openai_rollout_client_serves_one_event_loop_after_another(weight_server):
    """The trainer runs each step's rollouts in a new ``asyncio.run``; the client must work in each."""
    from closedloop.trainers.weight_sync import make_rollout_client

    client = make_rollout_client(f"openai:tiny@{weight_server}")
    params = SamplingParams(temperature=0, max_tokens=8)
    turns = [asyncio.run(client.generate([UserMessage(content=PROMPT)], None, params)) for _ in range(3)]
    assert all(t.completion_ids for t in turns)
    assert len({tuple(t.completion_ids) for t in turns}) == 1
    assert client.spec == f"openai:tiny@{weight_server}"


def test_bad_directories_are_refused_whole(weight_server, tiny_model_path, tmp_path):
    before = _served_greedy(weight_server)
    assert _load(weight_server, "relative/dir").status_code == 400
    r = _load(weight_server, tmp_path / "nowhere")
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    (tmp_path / "file.txt").write_text("x")
    assert _load(weight_server, tmp_path / "file.txt").status_code == 400
    r = _load(weight_server, tmp_path)
    assert r.status_code == 400 and "config.json" in r.json()["error"]["message"]
    assert httpx.post(server_root(weight_server) + "/closedloop/v1/load_weights", json={"dir": "x"},
                      timeout=10).status_code == 400
    # A model directory whose tensors do not fit: nothing is loaded, not even the tensors that fit.
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(tiny_model_path / "config.json", bad / "config.json")
    state = load_file(str(tiny_model_path / "model.safetensors"))
    name = next(k for k in state if k.endswith("q_proj.weight"))
    state = {k: (v + 1.0 if k != name else torch.zeros(3, 3)) for k, v in state.items()}
    save_file(state, str(bad / "model.safetensors"))
    r = _load(weight_server, bad)
    assert r.status_code == 400 and name in r.json()["error"]["message"]
    cfg = json.loads((tiny_model_path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    assert "llama" in _load(weight_server, bad).json()["error"]["message"]
    assert _served_greedy(weight_server) == before


def test_weight_updates_are_off_unless_the_server_allows_them(tiny_client, tiny_model_path, tmp_path):
    from closedloop.server import create_app

    with serve_app(create_app(tiny_client, "tiny")) as url:
        status = httpx.get(server_root(url) + "/closedloop/v1/weights", timeout=10).json()
        assert status["weight_updates"] is False
        r = _load(url, tiny_model_path)
        assert r.status_code == 403 and "--allow-weight-updates" in r.json()["error"]["message"]
        cfg = GRPOConfig(model=str(tiny_model_path), output_dir=str(tmp_path), rollout_model=f"openai:tiny@{url}")
        with pytest.raises(ValueError, match="--allow-weight-updates"):
            make_weight_sync(tiny_client, cfg)


def test_the_sync_is_chosen_by_the_rollout_engine(tiny_client, tiny_model_path, tmp_path):
    assert isinstance(make_weight_sync(tiny_client, GRPOConfig(model="m", output_dir=str(tmp_path))), LiveSync)
    hf = make_weight_sync(tiny_client, GRPOConfig(model="m", output_dir=str(tmp_path),
                                                  rollout_model=f"hf:{tiny_model_path}"))
    assert isinstance(hf, InProcessSync) and hf.kind == "hf"
    with pytest.raises(NotImplementedError, match="closedloop serve"):
        make_weight_sync(tiny_client, GRPOConfig(model="m", output_dir=str(tmp_path), rollout_model="openai:gpt-4o"))
    port = free_port()  # nothing listens there
    with pytest.raises(ConnectionError):
        make_weight_sync(tiny_client, GRPOConfig(model="m", output_dir=str(tmp_path),
                                                 rollout_model=f"openai:x@http://127.0.0.1:{port}/v1"), timeout_s=2)


def test_an_in_process_hf_engine_gets_the_trainer_weights(tiny_model_path):
    """``rollout_model: hf:PATH``: a second copy in this process is overwritten in place."""
    from closedloop.models.hf import HFClient

    torch.manual_seed(0)
    trainer = HFClient.from_pretrained(tiny_model_path).model
    engine = HFClient.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    InProcessSync(engine).push(trainer, 1)
    for k, v in trainer.state_dict().items():
        assert torch.equal(engine.model.state_dict()[k], v), k
    assert _local_greedy(engine) == _local_greedy(HFClient.from_model(trainer, engine.tokenizer))


def test_lora_pushes_merged_weights_under_the_base_names(tiny_model_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    names = [n for n, _ in base.named_parameters()]
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    pushed = dict(named_weights(peft))
    assert list(pushed) == names
    merged = peft.merge_and_unload()  # the reference merge (after named_weights: it mutates the model)
    ref = dict(merged.named_parameters())
    for n in names:
        assert torch.allclose(pushed[n], ref[n], atol=1e-6), n
    q = next(n for n in names if n.endswith("q_proj.weight"))
    assert not torch.allclose(pushed[q], dict(base.named_parameters())[q])


def test_serve_refuses_weight_updates_for_a_remote_model():
    r = subprocess.run([sys.executable, "-m", "closedloop", "serve", "--model", "openai:gpt-4o",
                        "--allow-weight-updates"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--allow-weight-updates" in r.stderr


def test_save_weights_writes_a_loadable_directory(tiny_model_path, tmp_path):
    from closedloop.models.hf import HFClient
    from closedloop.models.weights import read_hf_weights

    model = HFClient.from_pretrained(tiny_model_path).model
    sync = ClosedloopServerSync("http://127.0.0.1:9", tmp_path)
    from closedloop.trainers.weight_sync import save_weights

    for _ in range(2):  # overwritten, never nested or left half-written
        save_weights(model, sync.directory)
    state = read_hf_weights(str(sync.directory), model_type="qwen2")
    assert set(state) <= set(model.state_dict()) and not list(tmp_path.glob("*.tmp"))
    sync.close()
    assert not sync.directory.exists()


@pytest.mark.gpu
def test_vllm_engine_serves_the_trained_weights_after_grpo(tiny_model_path, tmp_path, monkeypatch):
    """GPU only: GRPO with ``rollout_model: vllm:PATH`` loads each update into the in-process engine
    (TRL's colocate path); afterwards the engine's greedy answer is the final model's."""
    if importlib.util.find_spec("vllm") is None or not torch.cuda.is_available():
        pytest.skip("needs vLLM and a CUDA device")
    from closedloop.models.hf import HFClient
    from closedloop.models.vllm_client import VLLMClient

    out = tmp_path / "out"
    cfg = GRPOConfig(model=str(tiny_model_path), output_dir=str(out), env="calc", env_options={"level": 1},
                     rollout_model=f"vllm:{tiny_model_path}", prompts_per_step=2, num_generations=2, max_steps=2,
                     max_env_steps=2, max_new_tokens=24, learning_rate=1e-3, per_device_batch_size=4, seed=3,
                     report_to="none")
    engines: list[Any] = []
    import closedloop.trainers.weight_sync as ws

    def client(spec: str, **kw: Any):
        c = VLLMClient(spec.split(":", 1)[1], weight_updates=True, max_model_len=1024, gpu_memory_utilization=0.2,
                       enforce_eager=True)
        engines.append(c)
        return c

    monkeypatch.setattr(ws, "make_rollout_client", client)  # the same engine, sized for a shared GPU
    train_grpo(cfg)
    [engine] = engines
    final = HFClient.from_pretrained(out, device="cuda")
    ids, lps = _local_greedy(engine)
    want_ids, want_lps = _local_greedy(final)
    assert ids[:8] == want_ids[:8]
    assert lps[:8] == pytest.approx(want_lps[:8], abs=2e-3)
    start = HFClient.from_pretrained(tiny_model_path, device="cuda")
    assert _local_greedy(start)[1][:8] != pytest.approx(lps[:8], abs=2e-3)
