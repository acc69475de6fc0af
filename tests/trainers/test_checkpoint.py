"""Checkpoints (atomic, rotated, servable, LoRA merged), the Ctrl-C guard, and metric sinks."""

from __future__ import annotations

import signal

import pytest
import torch

from closedloop.trainers.checkpoint import (CheckpointError, InterruptGuard, TrainerState, latest_checkpoint,
                                            list_checkpoints, load_checkpoint, resolve_resume, save_checkpoint)
from closedloop.trainers.reporting import MetricsReporter, ReporterError


@pytest.fixture()
def tiny(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    return (AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
            AutoTokenizer.from_pretrained(tiny_model_path))


def _step(model, opt):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_full_checkpoint_round_trip_and_rotation(tiny, tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = tiny
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (1, 2, 3):
        _step(model, opt)
        save_checkpoint(tmp_path, TrainerState(step=step, samples_seen=4 * step), model=model, tokenizer=tok,
                        optimizer=opt, save_total_limit=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    # A half-written directory (no trainer_state.json) is never picked up.
    (tmp_path / "checkpoint-9").mkdir()
    assert latest_checkpoint(tmp_path).name == "checkpoint-3"

    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = load_checkpoint(latest_checkpoint(tmp_path), model=fresh, optimizer=fresh_opt)
    assert state.step == 3 and state.samples_seen == 12
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    # The optimizer continues identically.
    _step(model, opt)
    _step(fresh, fresh_opt)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_is_a_servable_hf_directory(tiny, tmp_path):
    import asyncio

    from closedloop.messages import UserMessage
    from closedloop.models.base import SamplingParams
    from closedloop.models.hf import HFClient

    model, tok = tiny
    path = save_checkpoint(tmp_path, TrainerState(step=1), model=model, tokenizer=tok)
    client = HFClient.from_pretrained(path)
    turn = asyncio.run(client.generate([UserMessage(content="Hello!")], params=SamplingParams(temperature=0,
                                                                                               max_tokens=12)))
    assert turn.completion_ids and turn.prompt_ids


def test_lora_checkpoint_holds_merged_model_and_adapter(tiny, tiny_model_path, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model, tok = tiny
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a non-zero adapter, so merging matters
    base_before = {k: v.clone() for k, v in peft_model.get_base_model().state_dict().items() if "base_layer" in k}
    path = save_checkpoint(tmp_path, TrainerState(step=5), model=peft_model, tokenizer=tok)
    assert (path / "adapter" / "adapter_model.safetensors").is_file()
    # Saving did not touch the live model (no merge/unmerge round-off).
    for k, v in peft_model.get_base_model().state_dict().items():
        if k in base_before:
            assert torch.equal(v, base_before[k])

    ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17]])
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        assert not torch.allclose(plain(input_ids=ids).logits, want, atol=1e-2)

    # Resuming a LoRA run restores the adapter exactly.
    again = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    load_checkpoint(path, model=again)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, want)


def test_resolve_resume(tmp_path, tiny):
    assert resolve_resume(False, tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_resume(True, tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        resolve_resume(str(tmp_path), tmp_path)
    model, tok = tiny
    path = save_checkpoint(tmp_path, TrainerState(step=2), model=model)
    assert resolve_resume("auto", tmp_path) == path == resolve_resume(True, tmp_path) == resolve_resume(str(path), tmp_path)


def test_interrupt_guard_first_sigint_requests_second_raises():
    # A shell that starts the suite in the background ignores SIGINT; start from Python's default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _guard_round_trip()
    finally:
        signal.signal(signal.SIGINT, previous)


def _guard_round_trip():
    with InterruptGuard() as guard:
        signal.raise_signal(signal.SIGINT)
        assert guard.requested and guard.should_stop()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_reporter_writes_the_run_store(tmp_path):
    from closedloop.store import RunStore

    store = RunStore(tmp_path / "runs.duckdb")
    run_id = store.start_run(kind="train")
    with MetricsReporter(["store"], run_id=run_id, store=store, progress=False) as rep:
        rep.log(1, {"loss": torch.tensor(2.5), "lr": 1e-3, "note": "not a scalar"})
        rep.log(2, {"loss": 1.5})
    with MetricsReporter(["store"], run_id=run_id, store=store, is_main_process=False) as other_rank:
        other_rank.log(3, {"loss": 9.0})
    assert store.metrics(run_id) == [{"step": 1, "loss": 2.5, "lr": 1e-3}, {"step": 2, "loss": 1.5}]


def test_reporter_sink_errors(tmp_path):
    with pytest.raises(ReporterError, match="unknown report_to"):
        MetricsReporter(["mlflow"])
    with pytest.raises(ReporterError, match="no run store"):
        MetricsReporter(["store"])
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ReporterError, match=r"closedloop\[tensorboard\]"):
            MetricsReporter(["tensorboard"], log_dir=tmp_path)
    else:
        with MetricsReporter(["tensorboard"], log_dir=tmp_path, progress=False) as rep:
            rep.log(1, {"loss": 1.0})
        assert list(tmp_path.glob("events.out.tfevents.*"))
    for name in ("wandb", "trackio"):
        try:
            __import__(name)
        except ImportError:
            with pytest.raises(ReporterError, match=f"pip install {name}"):
                MetricsReporter([name])
