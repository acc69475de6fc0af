"""Trainer configs: YAML + --set overrides, clear errors, and the `closedloop train` CLI's handling of them."""

from __future__ import annotations

import pytest

from closedloop.trainers.config import (ConfigError, LoraSettings, SFTConfig, StoreSelection, TrainConfig,
                                        config_reference, load_config)

BASE = ["model=hf:/models/tiny", "output_dir=out"]


def write(tmp_path, text: str):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_yaml_then_overrides_with_nested_keys(tmp_path):
    cfg_file = write(tmp_path, "model: hf:/models/tiny\noutput_dir: out\nlearning_rate: 1.0e-4\n"
                               "lora:\n  r: 4\n  target_modules: [q_proj, v_proj]\nreport_to: [store, tensorboard]\n")
    cfg = load_config(SFTConfig, cfg_file, ["learning_rate=3e-4", "lora.alpha=16", "max_steps=7", "tags=[a, b]",
                                            "resume=auto", "max_grad_norm=null"])
    assert cfg.learning_rate == 3e-4  # the override wins over the file
    assert cfg.lora == LoraSettings(r=4, alpha=16, target_modules=["q_proj", "v_proj"])
    assert cfg.max_steps == 7 and cfg.tags == ["a", "b"] and cfg.resume == "auto" and cfg.max_grad_norm is None
    assert cfg.report_to == ["store", "tensorboard"]
    assert cfg.model_path == "/models/tiny"


def test_yaml_no_is_the_string_no(tmp_path):
    cfg = load_config(TrainConfig, write(tmp_path, "model: m\noutput_dir: o\nmixed_precision: no\n"),
                      ["mixed_precision=bf16"])
    assert cfg.mixed_precision == "bf16"
    assert load_config(TrainConfig, None, BASE + ["mixed_precision=no"]).mixed_precision == "no"


def test_override_creates_a_nested_section():
    cfg = load_config(SFTConfig, None, BASE + ["lora.r=8"])
    assert cfg.lora is not None and cfg.lora.r == 8 and cfg.lora.alpha == LoraSettings().alpha


@pytest.mark.parametrize("value,expected", [("none", []), ("[none]", []), ("store", ["store"]),
                                            ("all", ["store", "tensorboard", "trackio", "wandb"])])
def test_report_to_forms(value, expected):
    assert load_config(TrainConfig, None, BASE + [f"report_to={value}"]).report_to == expected


def test_store_dataset_forms(tmp_path):
    a = load_config(SFTConfig, None, BASE + ["dataset=store:graph=react,tag=expert,min_reward=1"]).dataset
    b = load_config(SFTConfig, write(tmp_path, "model: m\noutput_dir: o\ndataset:\n  store: {graph: react, "
                                               "tag: expert, min_reward: 1}\n")).dataset
    c = load_config(SFTConfig, None, BASE + ["dataset.graph=react", "dataset.tag=expert", "dataset.min_reward=1"]).dataset
    assert a == b == c == StoreSelection(graph="react", tag="expert", min_reward=1.0)
    assert load_config(SFTConfig, None, BASE + ["dataset=data/train.jsonl"]).dataset == "data/train.jsonl"


def test_unknown_yaml_key_names_valid_keys_and_suggests(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(SFTConfig, write(tmp_path, "model: m\noutput_dir: o\nlearning_rat: 0.1\n"))
    assert "learning_rat" in str(e.value) and "did you mean 'learning_rate'" in str(e.value)
    assert "per_device_batch_size" in str(e.value)  # the valid keys are listed


def test_unknown_nested_and_override_keys():
    with pytest.raises(ConfigError, match="unknown key 'lora.rank'.*did you mean 'lora.r'"):
        load_config(SFTConfig, None, BASE + ["lora.rank=4"])
    with pytest.raises(ConfigError, match="'seed' is not a nested section"):
        load_config(SFTConfig, None, BASE + ["seed.x=1"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(SFTConfig, None, BASE + ["max_steps"])
    with pytest.raises(ConfigError, match="unknown store filter"):
        load_config(SFTConfig, None, BASE + ["dataset=store:grap=react"])


@pytest.mark.parametrize("override,needle", [
    ("learning_rate=-1", "learning_rate"), ("lr_scheduler=exponential", "lr_scheduler"),
    ("mixed_precision=fp8", "mixed_precision"), ("report_to=[store, mlflow]", "mlflow"),
    ("report_to=[none, store]", "cannot be combined"), ("model=openai:gpt-4o", "local weights"),
    ("per_device_batch_size=0", "per_device_batch_size"),
])
def test_invalid_values_are_reported_with_the_field(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(SFTConfig, None, BASE + [override])


def test_missing_required_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="output_dir"):
        load_config(SFTConfig, None, ["model=m"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(SFTConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(SFTConfig, write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(SFTConfig, write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(ConfigError, match="packing needs max_length"):
        load_config(SFTConfig, None, BASE + ["packing=true", "max_length=null"])


def test_every_field_is_documented():
    for cls in (TrainConfig, SFTConfig, LoraSettings, StoreSelection):
        undocumented = [n for n, f in cls.model_fields.items() if not f.description]
        assert not undocumented, f"{cls.__name__}: {undocumented}"
    ref = config_reference(SFTConfig)
    assert "lora.r" in ref and "assistant_only_loss" in ref


def test_cli_errors_exit_2(tmp_path, capsys):
    from closedloop.cli import main

    assert main(["train", "nosuchtrainer", "--set", "model=m"]) == 2
    assert "unknown trainer 'nosuchtrainer'" in capsys.readouterr().err
    assert main(["train", "sft", "--set", "model=m", "--set", "output_dir=o", "--set", "bogus=1"]) == 2
    assert "unknown key 'bogus'" in capsys.readouterr().err
    assert main(["train", "sft", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert main(["train", "../etc", "--set", "model=m"]) == 2
    assert main(["train", "config", "--set", "model=m"]) == 2  # a module, but not a trainer
    assert "not a trainer" in capsys.readouterr().err


def test_cli_print_config(tmp_path, capsys):
    import yaml

    from closedloop.cli import main

    assert main(["train", "sft", "--config", str(write(tmp_path, "model: m\noutput_dir: o\n")), "--set", "lora.r=2",
                 "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["lora"]["r"] == 2 and printed["model"] == "m"


def test_core_cli_does_not_import_trainers():
    import subprocess
    import sys

    code = ("import sys, closedloop.cli as c; c.build_parser(); "
            "bad = [m for m in sys.modules if m.startswith('closedloop.trainers') or m in ('torch', 'accelerate', 'peft')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
