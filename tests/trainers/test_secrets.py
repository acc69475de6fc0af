"""Secrets planted in a training config never reach the files a trainer writes: each checkpoint's
``train_config.json``, the final model directory, the trainer state. Checked on the bytes of every
file under ``output_dir`` after a real SFT run, and after a checkpoint of a GRPO config whose
rollout server URL, environment options and graph options carry keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from closedloop.trainers.config import SFTConfig, load_config

URL_KEY = "sk-PLANTEDurlKey0123456789abcdef"
OPTION_KEY = "PLANTEDoptionValue0123456789"
TAG_KEY = "sk-PLANTEDtagKey0123456789abcdef"
ENV_KEY = "PLANTEDenvironmentSecret012345"


def _all_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


@pytest.fixture
def planted_env(monkeypatch):
    """A key in a format no pattern knows, caught because a sensitive variable holds it."""
    monkeypatch.setenv("MY_SERVICE_TOKEN", ENV_KEY)


def test_sft_run_writes_no_planted_secret(tiny_model_path, tmp_path, planted_env):
    from closedloop.trainers.sft import train_sft

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    out = tmp_path / "out"
    cfg = load_config(SFTConfig, None, [f"model=hf:{tiny_model_path}", f"output_dir={out}", f"dataset={data}",
                                        "report_to=none", "max_steps=1", "torch_threads=1",
                                        f"tags=[{TAG_KEY}, 'env {ENV_KEY}']"])
    train_sft(cfg)
    saved = json.loads((out / "checkpoint-1" / "train_config.json").read_text())
    assert saved["tags"] == ["[REDACTED]", "env [REDACTED]"] and saved["max_steps"] == 1
    written = _all_bytes(out)
    assert b"PLANTED" not in written


def test_grpo_checkpoint_config_is_redacted(tiny_model_path, tmp_path, planted_env):
    from transformers import AutoModelForCausalLM

    from closedloop.trainers.checkpoint import TrainerState, save_checkpoint
    from closedloop.trainers.grpo import GRPOConfig

    cfg = GRPOConfig(model=str(tiny_model_path), output_dir=str(tmp_path / "out"),
                     rollout_model=f"openai:policy@http://trainer:{URL_KEY}@10.0.0.7:8000/v1",
                     env_options={"api_key": OPTION_KEY, "level": 2},
                     graph_options={"headers": {"Authorization": f"Bearer {OPTION_KEY}"}},
                     tags=[f"via {ENV_KEY}"])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    path = save_checkpoint(tmp_path / "out", TrainerState(step=1), model=model, config=cfg)
    saved = json.loads((path / "train_config.json").read_text())
    assert saved["rollout_model"] == "openai:policy@http://[REDACTED]@10.0.0.7:8000/v1"
    assert saved["env_options"] == {"api_key": "[REDACTED]", "level": 2}  # what is not a secret stays
    assert b"PLANTED" not in _all_bytes(tmp_path / "out")
