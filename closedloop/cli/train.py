"""``closedloop train <trainer> --config cfg.yaml [--set key=value ...]``.

Generic over trainers: ``closedloop.trainers.<name>`` exposes ``CONFIG_CLASS`` (a pydantic config)
and ``run_from_config(config)``. Nothing under ``closedloop.trainers`` is imported until a
training is asked for, so the rest of the CLI never pays for torch, accelerate or peft (and the
core keeps not importing trainers). Bad input (unknown trainer, unknown key, invalid value)
exits with code 2; a Ctrl-C that saved a checkpoint exits with 130.

Everything the run will touch is checked before a model loads, each problem as one ``error:`` line:
the config's values (finite numbers), the model directory, the output directory (by writing a probe
there), the checkpoint to resume, the metric sinks' packages, the dataset and the run store, which
is opened here (so a file that is not a store, a locked or too new one, fails now, not after the
model is loaded). A run whose loss turns NaN or infinite stops with exit code 1, its store run
``failed`` with the reason, and no model saved from the bad step.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="fine-tune a model with a closedloop trainer (sft, grpo, dpo, cpref, ...)",
                       description="Train with closedloop.trainers.<trainer>; e.g. "
                                   "`closedloop train sft --config sft.yaml --set max_steps=100`.")
    p.add_argument("trainer", help="trainer name, e.g. sft, grpo, dpo or cpref")
    p.add_argument("--config", "-c", default=None, help="YAML config file (keys of the trainer's config)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (dotted for nested: lora.r=8; values parsed as YAML); repeatable")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--list-keys", action="store_true", help="list every config key with its default and meaning")
    p.set_defaults(func=handle)


def available_trainers() -> list[str]:
    """Trainer modules under ``closedloop.trainers`` (files that define ``CONFIG_CLASS``), found without
    importing them."""
    spec = importlib.util.find_spec("closedloop.trainers")
    names = []
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for f in sorted(Path(folder).glob("*.py")):
            if not f.name.startswith("_") and "CONFIG_CLASS" in f.read_text(errors="ignore"):
                names.append(f.stem)
    return sorted(set(names))


def load_trainer(name: str) -> Any:
    """The trainer module ``closedloop.trainers.<name>``; ``ValueError`` naming the available ones."""
    known = available_trainers()
    if not _NAME.match(name):
        raise ValueError(f"invalid trainer name {name!r}; available: {', '.join(known) or 'none'}")
    try:
        module = importlib.import_module(f"closedloop.trainers.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"closedloop.trainers.{name}":
            raise ValueError(f"unknown trainer {name!r}; available: {', '.join(known) or 'none'}") from e
        raise
    if not hasattr(module, "CONFIG_CLASS") or not hasattr(module, "run_from_config"):
        raise ValueError(f"closedloop.trainers.{name} is not a trainer (no CONFIG_CLASS / run_from_config); "
                         f"available: {', '.join(known) or 'none'}")
    return module


def _open_store(config: Any) -> str | None:
    """Open the run store the training will write (or read its dataset from) now, before any model
    loads; the reason it cannot be used, or None. The config validation has already refused paths
    that are not DuckDB files; this catches what only opening tells (a lock held by another process,
    a store written by a newer closedloop, a damaged file)."""
    from closedloop.trainers.config import StoreSelection

    paths = []
    if "store" in config.report_to:
        paths.append(config.store)
    dataset = getattr(config, "dataset", None)
    if isinstance(dataset, StoreSelection):
        paths.append(dataset.path or config.store)
    if not paths:
        return None
    import duckdb

    from closedloop.store import RunStore

    for path in dict.fromkeys(paths):
        try:
            (RunStore(path) if path else RunStore()).close()
        except (OSError, ValueError, RuntimeError, duckdb.Error) as e:
            shown = path or "the default run store"
            return f"run store {shown}: {type(e).__name__}: {e}".replace("\n", " ")
    return None


def handle(args: argparse.Namespace) -> int:
    try:
        module = load_trainer(args.trainer)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from closedloop.trainers.config import ConfigError, config_reference, load_config

    if args.list_keys:
        print(config_reference(module.CONFIG_CLASS))
        return 0
    try:
        config = load_config(module.CONFIG_CLASS, args.config, args.overrides, check_paths=not args.print_config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    problem = _open_store(config)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from closedloop.trainers.common import TrainingDivergedError

    try:
        result = module.run_from_config(config)
    except (ValueError, FileNotFoundError) as e:  # bad data found while setting up (an empty dataset, ...)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDivergedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if getattr(result, "interrupted", False):
        print(f"interrupted at step {getattr(result, 'step', '?')}; checkpoint {getattr(result, 'checkpoint', None)}. "
              f"Continue with --set resume=auto", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun / accelerate launch only rank 0 reports
        return 0
    out = getattr(result, "output_dir", None)
    metrics = getattr(result, "metrics", None) or {}
    summary = " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k in ("loss", "eval_loss", "reward"))
    print(f"done: {getattr(result, 'step', '?')} steps{' · ' + summary if summary else ''}"
          f"{f'; model saved to {out}' if out else ''}"
          f"{f'; run {result.run_id}' if getattr(result, 'run_id', None) else ''}")
    return 0
