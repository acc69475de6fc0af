"""Trainer configurations: pydantic models loadable from YAML with ``--set key=value`` overrides.

A trainer is a config plus a loop. Every field carries a description, so ``closedloop train`` can
explain a bad key, and defaults follow the reference (Hugging Face ``TrainingArguments`` / TRL)
unless a field's description says why closedloop differs. Unknown keys are errors, never silently
ignored: a misspelt ``learning_rat`` must not train with the default.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from closedloop.trainers import preflight
from closedloop.trainers.redacted_config import redacted_config

__all__ = ["ConfigError", "LoraSettings", "TrainConfig", "SFTConfig", "StoreSelection", "load_config",
           "model_path", "REPORT_TO_CHOICES", "config_reference", "parse_store_spec", "check_dataset", "checking_paths", "dataset_usable",
           "redacted_config", "read_yaml_mapping", "parse_override"]

REPORT_TO_CHOICES = ("store", "tensorboard", "trackio", "wandb")


class ConfigError(ValueError):
    """A trainer config that cannot be used: unknown key, bad value, unreadable file."""


class _Strict(BaseModel):
    # allow_inf_nan=False: `learning_rate=.inf` (YAML's infinity) would train a NaN model to the end.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def checking_paths(info: ValidationInfo) -> bool:
    """Paths are checked only when asked (``load_config(..., check_paths=True)``,
    :meth:`TrainConfig.check_paths`): a config can be written, printed and tested on a machine that
    does not have its files."""
    return bool(info.context and info.context.get("check_paths"))


class LoraSettings(_Strict):
    """LoRA adapters applied with ``peft`` (``LoraConfig``); the base weights stay frozen."""

    r: int = Field(16, ge=1, description="Adapter rank (peft's `r`; TRL's ModelConfig default 16).")
    alpha: int = Field(32, ge=1, description="Scaling numerator: updates are scaled by alpha / r (peft's `lora_alpha`).")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the adapter input (peft's `lora_dropout`).")
    target_modules: list[str] | str = Field(
        "all-linear", description="Module names to adapt (e.g. [q_proj, v_proj]) or 'all-linear' "
                                  "(every linear layer except the output head, as peft defines it).")
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases train (peft's `bias`).")


class TrainConfig(_Strict):
    """Settings every closedloop trainer shares: model, optimisation, precision, logging, checkpoints."""

    model: str = Field(..., description="The model to train: a local HF checkpoint directory or hub id, "
                                        "optionally written as an `hf:` spec (hf:PATH), as `closedloop serve` takes it.")
    output_dir: str = Field(..., description="Where checkpoints (`checkpoint-<step>/`, each an HF model directory) "
                                             "and the final model are written.")
    seed: int = Field(42, description="Seed for weight init of new parameters (LoRA), data order and dropout "
                                      "(TrainingArguments default 42).")
    learning_rate: float = Field(2e-5, gt=0, description="Peak learning rate of AdamW (TRL SFTConfig default 2e-5).")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "linear", description="Decay after warm-up: constant, linear to 0, or half-cosine to 0 "
                              "(transformers' get_*_schedule_with_warmup; default linear as in TrainingArguments).")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warm-up from 0 to learning_rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay, applied to all weights except "
                                                       "biases and norm weights (as transformers' Trainer).")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(1.0, description="Clip the global gradient L2 norm to this value; "
                                                         "null or <= 0 disables clipping (the norm is still logged).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps; overrides "
                                                          "num_epochs when set.")
    num_epochs: float = Field(3.0, gt=0, description="Passes over the data when max_steps is unset "
                                                     "(TrainingArguments default 3).")
    per_device_batch_size: int = Field(8, ge=1, description="Examples (or packed rows) per device per micro-batch.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step; the global batch "
                                             "is per_device_batch_size x accumulation x processes.")
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no", description="Autocast through accelerate; master weights stay in the loaded dtype (float32 by default).")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="Dtype the weights are loaded in. float32 master weights are what mixed precision "
                               "expects; 'auto' takes the checkpoint's.")
    max_length: int | None = Field(1024, ge=2, description="Truncate each example (or packed row) to this many tokens "
                                                           "(TRL SFTConfig default 1024); null keeps full length.")
    logging_steps: int = Field(10, ge=1, description="Report metrics every this many optimizer steps (TRL default 10).")
    save_steps: int | None = Field(500, ge=1, description="Save a checkpoint every this many optimizer steps; null "
                                                          "saves only at the end.")
    save_total_limit: int | None = Field(None, ge=1, description="Keep at most this many checkpoints, deleting the "
                                                                  "oldest; null keeps all.")
    resume: bool | str = Field(False, description="false: start fresh; true: continue from the latest checkpoint in "
                                                  "output_dir (error if none); 'auto': continue if one exists; or "
                                                  "the path of a checkpoint directory.")
    report_to: list[str] = Field(
        default_factory=lambda: ["store"],
        description="Metric sinks, as TRL's report_to: any of store (the closedloop run store), tensorboard, trackio, "
                    "wandb; 'none' (or []) for none. closedloop defaults to its own store, not TRL's 'none'.")
    store: str | None = Field(None, description="Run store file; null means $CLOSEDLOOP_STORE or "
                                                "~/.closedloop/runs.duckdb.")
    run_name: str | None = Field(None, description="A name for the run in every sink (default: the output_dir's name).")
    tags: list[str] = Field(default_factory=list, description="Tags recorded on the run (store, W&B).")
    lora: LoraSettings | None = Field(None, description="Train LoRA adapters with peft instead of all weights; "
                                                         "checkpoints then hold the merged model plus the adapter.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory "
                                                            "(transformers' gradient_checkpointing_enable).")
    torch_threads: int | None = Field(None, ge=1, description="torch.set_num_threads for the run (one thread is "
                                                              "fastest on small shared CPUs); null leaves it.")

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            value = [str(v) for v in value]
            if "all" in value:
                return list(REPORT_TO_CHOICES)
            if "none" in value:
                if len(value) > 1:
                    raise ValueError("report_to: 'none' cannot be combined with other sinks")
                return []
            bad = [v for v in value if v not in REPORT_TO_CHOICES]
            if bad:
                raise ValueError(f"report_to: unknown sink(s) {bad}; choose from {list(REPORT_TO_CHOICES)} or 'none'")
        return value

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False or value is None else value  # YAML 1.1 reads a bare `no` as false

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_value(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, str) and not value:
            raise ValueError("resume: give false, true, 'auto' or a checkpoint path")
        return value

    @field_validator("model")
    @classmethod
    def _model_spec(cls, value: str, info: ValidationInfo) -> str:
        if value.startswith(("openai:", "vllm:")):
            raise ValueError(f"model {value!r}: trainers need local weights; give a directory, hub id or hf:PATH")
        if not model_path(value):
            raise ValueError("model: empty path")
        if checking_paths(info) and not (info.context or {}).get("model_given"):
            preflight.check_model_dir(model_path(value))
        return value

    @field_validator("output_dir")
    @classmethod
    def _output_dir_writable(cls, value: str, info: ValidationInfo) -> str:
        if not value:
            raise ValueError("output_dir: empty path")
        if checking_paths(info):
            preflight.check_output_dir(value)
        return value

    @field_validator("resume")
    @classmethod
    def _resume_exists(cls, value: bool | str, info: ValidationInfo) -> bool | str:
        if checking_paths(info) and "output_dir" in info.data:
            preflight.check_resume(value, info.data["output_dir"])
        return value

    @field_validator("report_to")
    @classmethod
    def _sinks_installed(cls, value: list[str], info: ValidationInfo) -> list[str]:
        if checking_paths(info):
            preflight.check_sinks(value)
        return value

    @field_validator("store")
    @classmethod
    def _store_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and checking_paths(info):
            preflight.check_store_file(value, must_exist=False)
        return value

    def check_paths(self, *, model_given: bool = False) -> None:
        """Validate again with every path and sink checked (see :mod:`closedloop.trainers.preflight`);
        raises :class:`ConfigError`. Trainers call it before any work; ``model_given``: the caller
        passed the model and tokenizer objects, so ``model`` need not name a loadable directory."""
        try:
            type(self).model_validate(self.model_dump(), context={"check_paths": True, "model_given": model_given})
        except ValidationError as e:
            raise ConfigError(_format_validation(e, type(self))) from e

    @property
    def model_path(self) -> str:
        """The checkpoint path or hub id with any ``hf:`` prefix removed."""
        return model_path(self.model)


def model_path(spec: str) -> str:
    """``hf:PATH`` or ``PATH`` -> ``PATH`` (a trailing ``@device`` or options are not part of trainer specs)."""
    return spec[3:] if spec.startswith("hf:") else spec


class StoreSelection(_Strict):
    """Trajectories read back from the run store (``RunStore.iter_trajectories``)."""

    graph: str | None = Field(None, description="Only runs of this graph (e.g. react).")
    tag: str | None = Field(None, description="Only runs carrying this tag.")
    kind: str | None = Field(None, description="Only runs of this kind (run, eval, train, ...).")
    min_reward: float | None = Field(None, description="Only trajectories whose total reward is at least this.")
    status: str | None = Field("completed", description="Only runs with this status (null: any; failed or killed "
                                                        "episodes are rarely what one imitates).")
    limit: int | None = Field(None, ge=1, description="At most this many trajectories.")
    path: str | None = Field(None, description="The store file; null uses the config's `store`.")


def check_dataset(dataset: str | StoreSelection | None, store: str | None) -> None:
    """A dataset file that exists, or a store selection whose store file is a run store."""
    if isinstance(dataset, StoreSelection):
        from closedloop.config import default_store_path

        preflight.check_store_file(dataset.path or store or default_store_path(), must_exist=True,
                                   what="dataset store")
    elif dataset is not None:
        preflight.check_dataset_path(dataset)


def dataset_usable(value: Any, info: ValidationInfo) -> Any:
    """The ``dataset`` field validator of every config that has one (with the config's ``store``)."""
    if checking_paths(info):
        check_dataset(value, info.data.get("store"))
    return value


class SFTConfig(TrainConfig):
    """Supervised fine-tuning on conversations: loss only on what the assistant wrote."""

    dataset: str | StoreSelection | None = Field(
        None, description="Training data: a .jsonl/.json/.parquet file of chat rows ({'messages': [...], "
                          "'tools': [...]} or {'prompt': [...], 'completion': [...]}), loaded with `datasets`; or "
                          "trajectories from the run store, written `store:graph=react,tag=expert,min_reward=1` or as "
                          "a mapping {store: {graph: ..., tag: ..., kind: ..., min_reward: ...}}. Null when "
                          "trajectories are passed in Python.")
    packing: bool = Field(False, description="Concatenate examples into rows of max_length tokens with position_ids "
                                             "restarting at 0 per example and no padding (TRL's padding-free 'bfd' "
                                             "packing); attention stays within each example (see trainers/data.py).")
    assistant_only_loss: bool = Field(
        True, description="Loss only on tokens the assistant produced (its messages through the end-of-turn token), "
                          "from recorded masks or by rendering message prefixes. closedloop's default is true, unlike "
                          "TRL's false: training on user, tool and template tokens teaches the policy to imitate "
                          "its environment.")
    completion_only_loss: bool = Field(
        True, description="For prompt/completion rows: loss only on the completion (TRL's default for that format). "
                          "With both options false every token is trained on.")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="Hold out this fraction of examples (seeded) and "
                                                                  "report eval loss on them.")
    eval_steps: int | None = Field(None, ge=1, description="Evaluate every this many steps (null: only at the end).")
    shuffle: bool = Field(True, description="Shuffle examples each epoch (seeded by seed + epoch).")

    @field_validator("dataset", mode="before")
    @classmethod
    def _dataset_spec(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and set(value) == {"store"}:
            return StoreSelection.model_validate(value["store"] or {})
        if isinstance(value, str) and value.startswith("store:"):
            return parse_store_spec(value)
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        return value

    _dataset_exists = field_validator("dataset")(dataset_usable)

    @model_validator(mode="after")
    def _packing_needs_length(self) -> "SFTConfig":
        if self.packing and self.max_length is None:
            raise ValueError("packing needs max_length (the length of each packed row)")
        return self




def parse_store_spec(text: str) -> StoreSelection:
    """``store:graph=react,tag=expert,min_reward=1`` -> :class:`StoreSelection`."""
    import yaml

    body = text[len("store:"):].strip()
    fields: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, sep, raw = part.partition("=")
        if not sep:
            raise ValueError(f"dataset {text!r}: expected key=value pairs after 'store:', got {part!r}")
        fields[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    unknown = set(fields) - set(StoreSelection.model_fields)
    if unknown:
        raise ValueError(f"dataset {text!r}: unknown store filter(s) {sorted(unknown)}; "
                         f"valid: {sorted(StoreSelection.model_fields)}")
    return StoreSelection.model_validate(fields)


# --------------------------------------------------------------------------- loading

C = TypeVar("C", bound=BaseModel)


def _valid_keys(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted keys a config accepts, nested models expanded (``lora.r``)."""
    keys: list[str] = []
    for name, field in cls.model_fields.items():
        keys.append(prefix + name)
        for sub in _nested_models(field.annotation):
            keys.extend(_valid_keys(sub, prefix + name + "."))
    return keys


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [a for arg in typing.get_args(annotation) for a in _nested_models(arg)]


def _model_for(cls: type[BaseModel], dotted: list[str]) -> type[BaseModel] | None:
    """The nested model class a dotted prefix names, if it names one."""
    for part in dotted:
        field = cls.model_fields.get(part)
        subs = _nested_models(field.annotation) if field is not None else []
        if not subs:
            return None
        cls = subs[0]
    return cls


def _check_keys(cls: type[BaseModel], data: Mapping[str, Any], where: str, prefix: str = "") -> None:
    for key, value in data.items():
        if key not in cls.model_fields:
            valid = sorted(cls.model_fields)
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {prefix}{close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {prefix}{key!r}{hint}. Valid keys for {cls.__name__}: "
                              f"{', '.join(prefix + v for v in valid)}")
        sub = _model_for(cls, [key])
        if sub is not None and isinstance(value, Mapping) and not (key == "dataset" and set(value) == {"store"}):
            _check_keys(sub, value, where, prefix + key + ".")


def _set_dotted(data: dict[str, Any], cls: type[BaseModel], key: str, value: Any) -> None:
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"--set {key}=...: empty key segment")
    node = data
    for i, part in enumerate(parts[:-1]):
        if _model_for(cls, parts[: i + 1]) is None:
            raise ConfigError(f"--set {key}=...: {'.'.join(parts[:i + 1])!r} is not a nested section. "
                              f"Valid keys: {', '.join(_valid_keys(cls))}")
        child = node.get(part)
        if not isinstance(child, dict):
            child = {} if child is None else dict(child) if isinstance(child, Mapping) else {}
            node[part] = child
        node = child
    owner = _model_for(cls, parts[:-1]) if len(parts) > 1 else cls
    if owner is None or parts[-1] not in owner.model_fields:
        valid = _valid_keys(cls)
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"--set: unknown key {key!r}{hint}. Valid keys: {', '.join(valid)}")
    node[parts[-1]] = value


def _format_validation(err: ValidationError, cls: type[BaseModel]) -> str:
    """One line for one problem (the common case), one line per problem otherwise."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc or '(root)'}: {msg}")
    if len(lines) == 1:
        return f"invalid {cls.__name__}: {lines[0]}"
    return f"invalid {cls.__name__}:\n" + "\n".join("  " + line for line in lines)


def read_yaml_mapping(path: str | os.PathLike[str], what: str = "config file",
                      error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """The mapping a YAML file holds (empty file: ``{}``); ``error`` naming the file when it is
    missing, not YAML, or not a mapping."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {p} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise error(f"{what} {p} is not valid YAML: {e}") from e
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise error(f"{what} {p} must hold a mapping of keys to values, got {type(loaded).__name__}")
    return loaded


def parse_override(item: str, error: type[ValueError] = ConfigError) -> tuple[str, Any]:
    """``--set KEY=VALUE`` as ``(KEY, VALUE)``, the value parsed as YAML (``3`` an int, ``[a, b]`` a
    list, ``null`` None; text that is not YAML stays text; nothing after ``=`` is None)."""
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise error(f"--set {item!r}: expected key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(cls: type[C], path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None,
                *, check_paths: bool = False, **values: Any) -> C:
    """A config from a YAML file, then ``key=value`` overrides, then keyword values.

    Override keys may be dotted (``lora.r=8``); values are parsed as YAML scalars or flow
    collections (``report_to=[store,tensorboard]``, ``max_steps=null``). Unknown keys raise
    :class:`ConfigError` naming the valid ones; invalid values raise it with pydantic's reasons.
    ``check_paths``: also check that the model, output directory, checkpoint, store, dataset and
    metric sinks are usable (:mod:`closedloop.trainers.preflight`), as ``closedloop train`` does.
    """
    data: dict[str, Any] = {}
    if path is not None:
        loaded = read_yaml_mapping(path)
        _check_keys(cls, loaded, str(path))
        data.update(loaded)
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(data, cls, key, value)
    for key, value in values.items():
        _set_dotted(data, cls, key, value)
    try:
        return cls.model_validate(data, context={"check_paths": check_paths})
    except ValidationError as e:
        raise ConfigError(_format_validation(e, cls)) from e


def config_reference(cls: type[BaseModel]) -> str:
    """Every key with its default and description, for ``--help`` and docs."""
    lines = []
    for name, field in cls.model_fields.items():
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        lines.append(f"{name} ({default}): {field.description or ''}")
        for sub in _nested_models(field.annotation):
            for sname, sfield in sub.model_fields.items():
                sdefault = "required" if sfield.is_required() else repr(sfield.get_default(call_default_factory=True))
                lines.append(f"  {name}.{sname} ({sdefault}): {sfield.description or ''}")
    return "\n".join(lines)
