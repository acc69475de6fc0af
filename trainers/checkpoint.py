"""Checkpoints a trainer can resume from and a server can load.

``output_dir/checkpoint-<step>/`` is an ordinary Hugging Face model directory (``config.json``,
``model.safetensors``, tokenizer), so ``closedloop serve --model hf:DIR`` and
``HFClient.from_pretrained(DIR)`` load it as is. With LoRA it holds the *merged* weights (what a
server wants) and the adapter alone under ``adapter/`` (what resuming needs: the base weights
never change). Beside the model: ``optimizer.pt``, ``scheduler.pt``, one ``rng_state_<rank>.pt``
per process and ``trainer_state.json`` (step, data position, metrics).

A checkpoint is written into a hidden temporary directory and renamed into place, so a crash or a
second Ctrl-C mid-save never leaves a half checkpoint that ``resume="auto"`` would pick up.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

__all__ = ["CHECKPOINT_PREFIX", "TrainerState", "list_checkpoints", "latest_checkpoint", "resolve_resume",
           "save_checkpoint", "load_checkpoint", "save_hf_model", "save_final_model", "gather_state_dict",
           "rotate_checkpoints", "InterruptGuard", "unwrap_model", "rng_state", "set_rng_state", "CheckpointError"]

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
ADAPTER_DIR = "adapter"
_CKPT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found, read or applied to this model."""


class TrainerState(BaseModel):
    """What a loop needs besides tensors to continue exactly where it stopped."""

    step: int = Field(0, description="Optimizer steps completed.")
    epoch: float = Field(0.0, description="Fractional passes over the data so far.")
    samples_seen: int = Field(0, description="Examples (or packed rows) consumed: the data position.")
    tokens_seen: int = Field(0, description="Non-padding tokens processed.")
    run_id: str | None = Field(None, description="The run-store run this training belongs to.")
    metrics: dict[str, float] = Field(default_factory=dict, description="The last logged metrics.")
    trainer: str = Field("", description="Which trainer wrote it (sft, grpo, ...).")
    extra: dict[str, Any] = Field(default_factory=dict, description="Trainer-specific state (JSON-able).")


# --------------------------------------------------------------------------- finding checkpoints


def list_checkpoints(output_dir: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest (lowest step) first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _CKPT_RE.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint with the highest step in ``output_dir``, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def resolve_resume(resume: bool | str | None, output_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint a ``resume`` setting selects: False/None none, ``"auto"`` the latest if any,
    True the latest (error if none), a path that checkpoint (error if it is not one)."""
    if resume is None or resume is False:
        return None
    if resume == "auto" or resume is True:
        found = latest_checkpoint(output_dir)
        if found is None and resume is True:
            raise CheckpointError(f"resume=true but {output_dir} holds no checkpoint-<step> directory")
        return found
    path = Path(str(resume))
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"resume={resume!r}: not a checkpoint directory (no {STATE_FILE})")
    return path


def rotate_checkpoints(output_dir: str | os.PathLike[str], limit: int | None) -> list[Path]:
    """Delete the oldest checkpoints beyond ``limit``; returns what was deleted."""
    if limit is None:
        return []
    found = list_checkpoints(output_dir)
    doomed = found[: max(0, len(found) - limit)]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# --------------------------------------------------------------------------- models


def unwrap_model(model: Any, accelerator: Any = None) -> Any:
    """The model without DDP/accelerate/compile wrappers (a PeftModel stays a PeftModel)."""
    if accelerator is not None:
        model = accelerator.unwrap_model(model)
    while hasattr(model, "module") and model.__class__.__name__ in ("DistributedDataParallel", "DataParallel"):
        model = model.module
    return model


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def merged_state_dict(peft_model: Any) -> dict[str, Any]:
    """The base model's state dict with every LoRA delta added, computed without touching the
    live model (merge_and_unload would mutate it; merge/unmerge would perturb it by rounding)."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    deltas: dict[str, Any] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and hasattr(module, "base_layer"):
            delta = None
            for adapter in module.active_adapters:
                if adapter in module.lora_A or adapter in getattr(module, "lora_embedding_A", {}):
                    d = module.get_delta_weight(adapter)  # type: ignore[attr-defined]  # on every concrete LoRA layer
                    delta = d if delta is None else delta + d
            if delta is not None:
                deltas[name] = delta
    merged: dict[str, Any] = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key or "lora_embedding" in key:
            continue
        module_name, _, pname = key.rpartition(".")
        if module_name.endswith(".base_layer"):
            owner = module_name[: -len(".base_layer")]
            if pname == "weight" and owner in deltas:
                value = value + deltas[owner].to(value.dtype)
            key = f"{owner}.{pname}"
        merged[key] = value.detach()  # untouched tensors keep their storage, so tied weights stay tied
    return merged


def gather_state_dict(model: Any, accelerator: Any = None) -> dict[str, Any] | None:
    """The full state dict when weights are sharded (FSDP, DeepSpeed): a collective, so every
    process must call it. None for unsharded models (DDP, one process), which save directly."""
    if accelerator is None or _is_peft(unwrap_model(model, accelerator)):
        return None
    kind = str(getattr(accelerator, "distributed_type", ""))
    if "FSDP" in kind or "DEEPSPEED" in kind:
        return accelerator.get_state_dict(model)
    return None


def save_hf_model(model: Any, tokenizer: Any, directory: str | os.PathLike[str], *, accelerator: Any = None,
                  state_dict: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (merged if it is a LoRA PeftModel, plus its adapter under ``adapter/``) and
    the tokenizer as a Hugging Face directory. Call on the main process only; with sharded
    weights pass ``state_dict=gather_state_dict(...)`` (gathered on every process), or use
    :func:`save_final_model`, which does both."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = unwrap_model(model, accelerator)
    if _is_peft(model):
        base = model.get_base_model()
        base.save_pretrained(directory, state_dict=merged_state_dict(model))
        model.save_pretrained(directory / ADAPTER_DIR)
    elif state_dict is not None:
        model.save_pretrained(directory, state_dict=state_dict)
    else:
        model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def _load_model_weights(model: Any, directory: Path) -> None:
    """Restore trainable weights from a checkpoint: the adapter for LoRA, else the full model."""
    import torch
    from safetensors.torch import load_file

    if _is_peft(model):
        from peft import set_peft_model_state_dict

        file = directory / ADAPTER_DIR / "adapter_model.safetensors"
        if not file.is_file():
            raise CheckpointError(f"{directory} has no LoRA adapter ({file}); was it saved without LoRA?")
        result = set_peft_model_state_dict(model, load_file(str(file)))
        unexpected = getattr(result, "unexpected_keys", []) or []
        if unexpected:
            raise CheckpointError(f"adapter in {directory} does not fit this model: unexpected {unexpected[:5]}")
        return
    files = sorted(directory.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no model*.safetensors")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set()
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        tied = {"lm_head.weight"}
    bad_missing = [k for k in missing if k not in tied]
    if bad_missing or unexpected:
        raise CheckpointError(f"checkpoint {directory} does not match the model: missing {bad_missing[:5]}, "
                              f"unexpected {list(unexpected)[:5]}")


# --------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and every CUDA device) generator states."""
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- save / load


def _rank(accelerator: Any) -> tuple[int, bool]:
    if accelerator is None:
        return 0, True
    return accelerator.process_index, accelerator.is_main_process


def _barrier(accelerator: Any) -> None:
    if accelerator is not None:
        accelerator.wait_for_everyone()


def save_checkpoint(output_dir: str | os.PathLike[str], state: TrainerState, *, model: Any, tokenizer: Any = None,
                    optimizer: Any = None, scheduler: Any = None, accelerator: Any = None,
                    save_total_limit: int | None = None, config: Any = None) -> Path:
    """Write ``output_dir/checkpoint-<state.step>`` atomically; every process must call it (each
    saves its RNG state; the main process writes the rest and renames). Returns the final path.

    An existing checkpoint of the same step is replaced. ``config`` (a pydantic model or dict) is
    saved as ``train_config.json`` for the record, with credentials redacted.
    """
    import torch

    output_dir = Path(output_dir)
    rank, main = _rank(accelerator)
    final = output_dir / f"{CHECKPOINT_PREFIX}{state.step}"
    tmp = output_dir / f".{final.name}.tmp"
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(accelerator)
    torch.save(rng_state(), tmp / f"rng_state_{rank}.pt")
    full = gather_state_dict(model, accelerator)
    if main:
        save_hf_model(model, tokenizer, tmp, accelerator=accelerator, state_dict=full)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        if config is not None:  # credentials redacted: a checkpoint is copied and shared
            from closedloop.trainers.redacted_config import redacted_config

            (tmp / "train_config.json").write_text(json.dumps(redacted_config(config), indent=2, default=str))
    _barrier(accelerator)
    if main:
        (tmp / STATE_FILE).write_text(state.model_dump_json(indent=2))  # last: marks the checkpoint complete
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        rotate_checkpoints(output_dir, save_total_limit)
    _barrier(accelerator)
    return final


def save_final_model(model: Any, tokenizer: Any, directory: str | os.PathLike[str], *, accelerator: Any = None) -> Path:
    """The final model as an HF directory; every process calls it (weights are gathered first
    when sharded), the main process writes."""
    full = gather_state_dict(model, accelerator)
    if _rank(accelerator)[1]:
        save_hf_model(model, tokenizer, directory, accelerator=accelerator, state_dict=full)
    _barrier(accelerator)
    return Path(directory)


def load_checkpoint(path: str | os.PathLike[str], *, model: Any, optimizer: Any = None, scheduler: Any = None,
                    accelerator: Any = None, restore_rng: bool = True) -> TrainerState:
    """Restore weights, optimizer, scheduler and (this rank's) RNG from ``path``; returns its state."""
    import torch

    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{path} is not a checkpoint (no {STATE_FILE})")
    state = TrainerState.model_validate_json(state_file.read_text())
    _load_model_weights(unwrap_model(model, accelerator), path)
    if optimizer is not None:
        file = path / "optimizer.pt"
        if not file.is_file():
            raise CheckpointError(f"{path} has no optimizer.pt; cannot resume the optimizer")
        optimizer.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
    if scheduler is not None and (path / "scheduler.pt").is_file():
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True))
    if restore_rng:
        rank, _ = _rank(accelerator)
        file = path / f"rng_state_{rank}.pt"
        if not file.is_file():
            file = path / "rng_state_0.pt"  # resuming with more processes than saved: best effort
        if file.is_file():
            set_rng_state(torch.load(file, map_location="cpu", weights_only=False))
    return state


# --------------------------------------------------------------------------- Ctrl-C


class InterruptGuard:
    """Turn the first Ctrl-C (SIGINT) into a request to stop at the next step boundary, so the
    loop can save a checkpoint and exit cleanly; a second Ctrl-C interrupts at once.

    ``with InterruptGuard() as guard: ... if guard.should_stop(accelerator): save; break``.
    Outside the main thread (where signal handlers cannot be installed) it only watches
    :meth:`request`. Under DDP, :meth:`should_stop` agrees across processes, so all stop at the
    same step (a process that stopped alone would hang the others in the next all-reduce).
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def request(self) -> None:
        self.requested = True

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def should_stop(self, accelerator: Any = None) -> bool:
        if accelerator is None or accelerator.num_processes == 1:
            return self.requested
        import torch

        flag = torch.tensor([1.0 if self.requested else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
