"""`closedloop train` refuses unusable configs before any work, and stops a diverging run.

Each bad input of the second reliability round gets one `error:` line naming the key, exit code 2,
and leaves nothing behind: no store run (the store file is not even created), nothing in the
output directory. A run whose loss turns NaN stops with exit code 1, saves no model, and its store
run is `failed` with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from closedloop.cli import main
from closedloop.store import RunStore
from closedloop.trainers.config import ConfigError, SFTConfig, load_config


@pytest.fixture
def data(tmp_path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
            for i in range(8)]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _train(tiny_model_path, tmp_path, data, *overrides: str) -> int:
    base = {"model": f"hf:{tiny_model_path}", "output_dir": str(tmp_path / "out"), "dataset": str(data),
            "store": str(tmp_path / "runs.duckdb"), "max_steps": "2", "per_device_batch_size": "2",
            "torch_threads": "1", "save_steps": "null"}
    for item in overrides:
        key, _, value = item.partition("=")
        base[key] = value
    argv = ["train", "sft"]
    for key, value in base.items():
        argv += ["--set", f"{key}={value}"]
    return main(argv)


def _not_installed(*names: str) -> str | None:
    return next((n for n in names if importlib.util.find_spec(n) is None), None)


def _bad_inputs(tmp_path: Path, data: Path) -> dict[str, tuple[list[str], str]]:
    """Each case: the overrides, and what the error line must say."""
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a store\n")
    not_a_model = tmp_path / "empty-model"
    not_a_model.mkdir()
    damaged = tmp_path / "damaged.duckdb"  # DuckDB's magic bytes, garbage after: only opening tells
    damaged.write_bytes(os.urandom(8) + b"DUCK" + os.urandom(8000))
    cases = {
        "infinite learning rate": (["learning_rate=.inf"], "learning_rate: Input should be a finite number"),
        "nan weight decay": (["weight_decay=.nan"], "weight_decay"),
        "missing model": ([f"model=hf:{tmp_path / 'nope'}"], "no such directory"),
        "model dir without config": ([f"model={not_a_model}"], "not a Hugging Face model directory"),
        "output_dir is a file": ([f"output_dir={text_file}"], "is a file, not a directory"),
        "output_dir under a file": ([f"output_dir={text_file / 'sub'}"], "cannot be created"),
        "resume without checkpoint": (["resume=true"], "holds no checkpoint"),
        "resume a non-checkpoint": ([f"resume={tmp_path}"], "not a checkpoint directory"),
        "dataset missing": ([f"dataset={tmp_path / 'none.jsonl'}"], "no such file"),
        "dataset store is a text file": ([f"dataset={{store: {{path: {text_file}}}}}"], "not a DuckDB database"),
        "dataset store missing": ([f"dataset={{store: {{path: {tmp_path / 'none.duckdb'}}}}}"], "no such run store"),
        "store is a text file": ([f"store={text_file}"], "not a DuckDB database"),
        "store is a directory": ([f"store={tmp_path}"], "is a directory"),
        "store in a missing directory": ([f"store={tmp_path / 'no' / 'dir' / 'runs.duckdb'}"], "does not exist"),
        "store is damaged": ([f"store={damaged}"], f"run store {damaged}"),
    }
    if Path("/dev/null").exists():
        cases["store is a device"] = (["store=/dev/null"], "not a regular file")
    if Path("/proc/self").is_dir():  # a directory no file can be created in (even by root)
        cases["output_dir not writable"] = (["output_dir=/proc/self"], "is not writable")
    missing = _not_installed("wandb", "trackio", "tensorboard")
    if missing:
        cases["sink not installed"] = ([f"report_to=[store, {missing}]"], f"{missing} is not installed")
    return cases


CASES = ["infinite learning rate", "nan weight decay", "missing model", "model dir without config",
         "output_dir is a file", "output_dir under a file", "resume without checkpoint", "resume a non-checkpoint",
         "dataset missing", "dataset store is a text file", "dataset store missing", "store is a text file",
         "store is a directory", "store in a missing directory", "store is damaged", "store is a device",
         "output_dir not writable", "sink not installed"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_error_line_before_any_work(case, tiny_model_path, tmp_path, data, capsys):
    cases = _bad_inputs(tmp_path, data)
    if case not in cases:
        pytest.skip(f"{case}: not available on this machine")
    overrides, needle = cases[case]
    assert _train(tiny_model_path, tmp_path, data, *overrides) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err[-2000:]
    assert needle in lines[0]
    assert "Traceback" not in captured.err + captured.out
    # Nothing was started: no model loaded, no run recorded, no output written.
    assert not (tmp_path / "runs.duckdb").exists() or not RunStore(tmp_path / "runs.duckdb").list_runs()
    assert not (tmp_path / "out").exists()


def test_paths_are_checked_only_when_asked(tmp_path):
    """Writing, printing and testing a config needs none of its files; training does."""
    overrides = ["model=hf:/nowhere/model", f"output_dir={tmp_path / 'out'}", "dataset=/nowhere/data.jsonl"]
    cfg = load_config(SFTConfig, None, overrides)
    with pytest.raises(ConfigError, match="model '/nowhere/model': no such directory"):
        cfg.check_paths()
    with pytest.raises(ConfigError, match="dataset '/nowhere/data.jsonl'"):
        cfg.check_paths(model_given=True)  # a model passed in Python: its path is not needed, the data is
    with pytest.raises(ConfigError, match="no such directory"):
        load_config(SFTConfig, None, overrides, check_paths=True)
    assert not (tmp_path / "out").exists()  # the writability probe left nothing behind


def test_a_diverging_run_stops_with_the_reason_and_saves_no_model(tiny_model_path, tmp_path, data, capsys):
    """learning_rate=1e30 is finite, so the config passes; Adam's first step moves every weight by about
    1e30 and the second step's loss is NaN. The run stops before applying it: no final model, no
    checkpoint, exit code 1, and the store run says why."""
    rc = _train(tiny_model_path, tmp_path, data, "learning_rate=1e30", "max_steps=4", "logging_steps=1")
    err = capsys.readouterr().err
    assert rc == 1, err[-2000:]
    assert "error: training diverged at step 2: loss=nan" in err and "Traceback" not in err
    out = tmp_path / "out"
    assert not (out / "model.safetensors").exists() and not list(out.glob("checkpoint-*"))
    (run,) = RunStore(tmp_path / "runs.duckdb").list_runs(kind="train")
    assert run.status == "failed" and "training diverged at step 2" in (run.error or "")
    assert [m["step"] for m in RunStore(tmp_path / "runs.duckdb").metrics(run.id)] == [1]


def test_a_failure_after_the_run_opened_is_recorded_not_left_running(tiny_model_path, tmp_path, data):
    """A failure mid-run (here the output directory is replaced by a file after step 1, so the step-2
    checkpoint cannot be written) used to leave the store run `running`, read back as `killed`; the
    run now records the real error."""
    import shutil

    from closedloop.trainers.sft import train_sft

    out = tmp_path / "out"
    cfg = load_config(SFTConfig, None, [f"model=hf:{tiny_model_path}", f"output_dir={out}", f"dataset={data}",
                                        f"store={tmp_path / 'runs.duckdb'}", "max_steps=3", "save_steps=2",
                                        "per_device_batch_size=2", "torch_threads=1"])

    def sabotage(step, metrics):
        if step == 1:
            shutil.rmtree(out)
            out.write_text("in the way")

    with pytest.raises(OSError) as raised:
        train_sft(cfg, on_step=sabotage)
    (run,) = RunStore(tmp_path / "runs.duckdb").list_runs(kind="train")
    assert run.status == "failed" and type(raised.value).__name__ in (run.error or "")


def test_stop_if_diverged_names_the_values():
    from closedloop.trainers.common import TrainingDivergedError, stop_if_diverged

    stop_if_diverged(3, loss=0.5, grad_norm=2.0)
    with pytest.raises(TrainingDivergedError, match=r"at step 3: grad_norm=inf"):
        stop_if_diverged(3, loss=0.5, grad_norm=float("inf"))


def test_train_entry_points_check_before_loading(tmp_path):
    """From Python too: the DPO and GRPO entry points refuse a missing model before loading anything."""
    from closedloop.trainers.dpo import DPOConfig, train_dpo
    from closedloop.trainers.grpo import GRPOConfig, train_grpo

    for cls, train in ((DPOConfig, train_dpo), (GRPOConfig, train_grpo)):
        cfg = load_config(cls, None, [f"model={tmp_path / 'missing'}", f"output_dir={tmp_path / 'o'}"])
        with pytest.raises(ConfigError, match="no such directory"):
            train(cfg)
    assert not (tmp_path / "o").exists()
