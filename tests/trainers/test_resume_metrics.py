"""A training run SIGKILLed several times and resumed each time logs every step's metrics once.

A run killed after logging steps past its last checkpoint replays those steps when it resumes;
they were logged already and must not be logged again (the round-two probe found 13 duplicate
``metrics`` rows over 4 kills). The kills are real: the training process sends itself SIGKILL from
its step callback, right after a step was logged and before the checkpoint that step would save,
so which steps are replayed is fixed by the test, not by timing.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import duckdb
import pytest

from closedloop.store import RunStore

CHILD = """
import os, signal, sys
from closedloop.trainers.config import load_config
from closedloop.trainers.dpo import DPOConfig, train_dpo
from closedloop.trainers.sft import SFTConfig, train_sft

trainer, kill_at = sys.argv[1], int(sys.argv[2])

def on_step(step, metrics):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

cls, train = {"sft": (SFTConfig, train_sft), "dpo": (DPOConfig, train_dpo)}[trainer]
train(load_config(cls, None, sys.argv[3:]), on_step=on_step)
"""

USER = [{"role": "user", "content": "hi"}]


def _rows(trainer: str) -> list[dict]:
    if trainer == "sft":
        return [{"messages": USER + [{"role": "assistant", "content": f"hello {i}"}]} for i in range(6)]
    return [{"prompt": USER, "chosen": [{"role": "assistant", "content": f"hello {i}"}],
             "rejected": [{"role": "assistant", "content": f"go away {i}"}]} for i in range(6)]


# SFT is killed after step 5 (checkpoint 3: replays 4, 5), after 7 (checkpoint 6: replays 7) and after
# 8 (checkpoint 6: replays 7, 8); DPO (the loop of TrainingSession, shared with GRPO) after step 5.
# The last attempt finishes.
@pytest.mark.parametrize("trainer, kills", [("sft", (5, 7, 8)), ("dpo", (5,))])
def test_killed_and_resumed_run_logs_each_step_once(trainer, kills, tiny_model_path, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in _rows(trainer)) + "\n")
    store_path = tmp_path / "runs.duckdb"
    overrides = [f"model=hf:{tiny_model_path}", f"output_dir={tmp_path / 'out'}", f"dataset={data}",
                 f"store={store_path}", "max_steps=10", "logging_steps=1", "save_steps=3", "resume=auto",
                 "per_device_batch_size=2", "torch_threads=1"]
    for kill_at in (*kills, 0):
        proc = subprocess.run([sys.executable, "-c", CHILD, trainer, str(kill_at), *overrides], capture_output=True,
                              text=True, cwd=tmp_path, timeout=600)
        assert proc.returncode == (-signal.SIGKILL if kill_at else 0), proc.stderr[-3000:]

    store = RunStore(store_path)
    (run,) = store.list_runs(kind="train")
    assert run.status == "completed" and run.metadata["attempts"] == len(kills) + 1
    with duckdb.connect(str(store_path), read_only=True) as con:
        rows = con.execute("SELECT step, name, count(*) FROM metrics WHERE run_id = ? GROUP BY step, name",
                           [run.id]).fetchall()
    assert {step for step, _, _ in rows} == set(range(1, 11))
    assert [(step, name, n) for step, name, n in rows if n != 1] == []
    assert len({name for _, name, _ in rows}) >= 5  # loss, lr, grad_norm, ...: each counted once per step
