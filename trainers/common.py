"""What every closedloop trainer sets up the same way: accelerator, model (+LoRA), optimizer,
schedule, and its run in the store. Kept apart from the loops so SFT and GRPO cannot drift.

Deliberate choices: the LR scheduler is *not* passed through ``accelerator.prepare`` (accelerate
would step it once per process under DDP, so a schedule would run N times too fast unless
``split_batches``); the loops step it once per optimizer step. Gradient accumulation and loss
normalisation are done by the loops, not by ``Accelerator(gradient_accumulation_steps=...)``,
because the loss is divided by the token count of the whole global batch (as transformers'
Trainer does with ``num_items_in_batch``), which makes one step independent of how the batch is
split across micro-batches and processes.
"""

from __future__ import annotations

import math
import os
from typing import Any

from closedloop.trainers.config import TrainConfig

__all__ = ["make_accelerator", "load_model_and_tokenizer", "load_tokenizer", "apply_lora", "build_optimizer",
           "build_scheduler", "open_run", "pad_token_id", "TrainingDivergedError", "stop_if_diverged", "steps_logged",
           "world_size"]


class TrainingDivergedError(RuntimeError):
    """The loss or the gradient norm of a step is NaN or infinite. The step is not applied and
    nothing is saved from it: the weights and every checkpoint stay finite."""


def stop_if_diverged(step: int | None, accelerator: Any = None, **values: Any) -> None:
    """Raise :class:`TrainingDivergedError` when a value (a float or a tensor) is not finite; call it
    just before ``optimizer.step()``. With an accelerator running several processes the verdict is
    agreed on (one all-reduce), so all of them stop at the same step instead of some waiting forever
    in the next collective."""
    bad = {k: float(v) for k, v in values.items() if not math.isfinite(float(v))}
    elsewhere = False
    if accelerator is not None and accelerator.num_processes > 1:
        import torch

        flag = torch.tensor([1.0 if bad else 0.0], device=accelerator.device)
        elsewhere = float(accelerator.reduce(flag, reduction="sum").item()) > 0 and not bad
    if bad or elsewhere:
        what = ", ".join(f"{k}={v}" for k, v in bad.items()) if bad else "a non-finite value on another process"
        at = f" at step {step}" if step is not None else ""
        raise TrainingDivergedError(f"training diverged{at}: {what}; the step was not applied and "
                                    f"nothing was saved from it (lower learning_rate, set max_grad_norm, or check "
                                    f"the data)")


def steps_logged(store: Any, run_id: str | None) -> int:
    """The last step the store holds metrics for in ``run_id`` (0: none). A run resumed from a
    checkpoint older than its last logged step replays the steps in between; their metrics are
    already recorded and must not be logged twice."""
    if store is None or run_id is None:
        return 0
    return max((int(row["step"]) for row in store.metrics(run_id)), default=0)


def world_size() -> int:
    """The number of training processes, known before the accelerator exists (``WORLD_SIZE``, set by
    ``torchrun`` and ``accelerate launch``): a loop needs it to size the global batch, hence the
    schedule, before the session builds the optimizer."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def requested_processes() -> int | None:
    """How many processes ``accelerate launch`` was asked for, when it started this process itself.

    On a machine without GPUs ``accelerate launch --num_processes 2`` (``--cpu`` or not) takes its
    single-process path: it starts one process, passes nothing of the request on, and the job
    trains on half the data with exit code 0. Only the launcher's command line still says what was
    asked, so it is read from the parent process (None when the parent is not ``accelerate launch``
    or says nothing)."""
    if not any(k.startswith("ACCELERATE_") for k in os.environ):
        return None
    try:
        import psutil

        argv = psutil.Process(os.getppid()).cmdline()
    except Exception:  # noqa: BLE001 - no psutil, no parent, no permission: nothing to compare
        return None
    if "launch" not in argv or not any(os.path.basename(a).startswith("accelerate") for a in argv[:3]):
        return None
    for i, arg in enumerate(argv):
        for flag in ("--num_processes", "--num-processes"):
            value = argv[i + 1] if arg == flag and i + 1 < len(argv) else \
                arg.split("=", 1)[1] if arg.startswith(flag + "=") else None
            if value is not None and value.isdigit():
                return int(value)
    return None


def fewer_processes_warning() -> str | None:
    """The warning when ``accelerate launch`` started fewer processes than it was asked for."""
    asked = requested_processes()
    if asked is None or asked <= world_size():
        return None
    return (f"warning: accelerate launch was asked for {asked} processes but started {world_size()}: without GPUs, "
            f"--num_processes alone runs one process. For {asked} processes on CPU (gloo) use "
            f"`accelerate launch --multi_gpu --num_processes {asked} ...` or `torchrun --nproc_per_node {asked} ...`")


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def make_accelerator(config: TrainConfig) -> Any:
    """An ``accelerate.Accelerator`` with the config's mixed precision (DDP/FSDP/DeepSpeed come from
    ``accelerate launch``/``torchrun`` and the accelerate config, not from here)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    # The accelerator state is a process-wide singleton; a second single-process training in the
    # same Python process (tests, notebooks) with another precision must be allowed to reset it.
    if AcceleratorState._shared_state and world_size() == 1:
        if str(AcceleratorState().mixed_precision) != config.mixed_precision:
            AcceleratorState._reset_state(reset_partial_state=True)
    import torch

    # accelerate runs several CPU processes (gloo) only when told the job is on CPU; under
    # torchrun without an accelerator device, say so, or every rank would train alone.
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or \
        (world_size() > 1 and not torch.cuda.is_available())
    return Accelerator(mixed_precision=config.mixed_precision, cpu=cpu)


def pad_token_id(tokenizer: Any) -> int:
    for cand in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(cand, int):
            return cand
    raise ValueError("the tokenizer has neither a pad nor an eos token")


def load_tokenizer(config: TrainConfig, tokenizer: Any = None) -> Any:
    """``config.model``'s tokenizer (or ``tokenizer``), which must have a chat template: every
    trainer renders conversations with it."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer of {config.model!r} has no chat template; SFT on conversations needs one")
    return tokenizer


def load_model_and_tokenizer(config: TrainConfig, model: Any = None, tokenizer: Any = None) -> tuple[Any, Any]:
    """The model (in ``config.dtype``, training mode, gradient checkpointing, LoRA if configured)
    and its tokenizer; a given ``model``/``tokenizer`` is used as is (LoRA still applied)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = config.model_path
    tokenizer = load_tokenizer(config, tokenizer)
    if model is None:
        dtype: Any = "auto" if config.dtype == "auto" else getattr(torch, _DTYPES[config.dtype])
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except OSError as e:
            raise ValueError(f"cannot load model {config.model!r}: {e}") from e
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if config.lora is not None:
        model = apply_lora(model, config)
    model.train()
    return model, tokenizer


def apply_lora(model: Any, config: TrainConfig) -> Any:
    from peft import LoraConfig, get_peft_model

    lora = config.lora
    assert lora is not None
    peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=lora.target_modules, bias=lora.bias, task_type="CAUSAL_LM")
    if config.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    return get_peft_model(model, peft_config)


def build_optimizer(model: Any, config: TrainConfig) -> Any:
    """AdamW over trainable parameters; weight decay on matrices only (not on biases or norm
    weights, i.e. 1-D parameters, as transformers' Trainer)."""
    import torch

    decay: list[Any] = []
    no_decay: list[Any] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters")
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # torch picks the multi-tensor (foreach) update only on CUDA; on the CPU it loops over parameters in
    # Python, one GIL hand-off per op, which stalls the trainer whenever a rollout thread holds the GIL.
    # The foreach update computes the same numbers (tests/trainers/test_optimizer.py).
    on_cpu = all(p.device.type == "cpu" for p in decay + no_decay)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.learning_rate,
                             betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
                             foreach=True if on_cpu else None)


def build_scheduler(optimizer: Any, config: TrainConfig, total_steps: int) -> Any:
    """transformers' warm-up + constant / linear / cosine schedule over ``total_steps`` optimizer steps."""
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[config.lr_scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=max(1, total_steps))


def open_run(config: TrainConfig, trainer: str, accelerator: Any, run_id: str | None = None,
             metadata: dict[str, Any] | None = None) -> tuple[Any, str | None]:
    """On the main process with ``"store"`` in ``report_to``: the store and a ``kind="train"`` run
    (``run_id`` given: that run reopened, as on resume). Else ``(None, None)``."""
    if "store" not in config.report_to or not accelerator.is_main_process:
        return None, None
    from closedloop.store import RunStore

    store = RunStore(config.store) if config.store else RunStore()
    if run_id is not None:
        try:
            store.reopen_run(run_id, config=config)
            return store, run_id
        except Exception as e:  # the run was deleted, or is still marked running by a live process
            import warnings

            warnings.warn(f"cannot reopen run {run_id} ({e}); recording the resumed training as a new run",
                          RuntimeWarning, stacklevel=2)
    run_id = store.start_run(kind="train", model_spec=config.model, config=config.model_dump(mode="json"),
                             tags=list(config.tags), metadata={"trainer": trainer, "run_name": config.run_name,
                                                                "output_dir": config.output_dir, **(metadata or {})})
    return store, run_id
