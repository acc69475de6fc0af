"""``closedloop train <trainer> --config cfg.yaml [--set key=value ...]``: fine-tune a model with a trainer.

Generic over trainers: a trainer is a plugin (an entry point of ``closedloop.trainers``, see
:mod:`closedloop.plugins`) naming a module that exposes ``CONFIG_CLASS`` (a pydantic config) and
``run_from_config(config)``. No trainer is imported until a training is asked for, so the rest of
the CLI never pays for torch, accelerate or peft (and the core keeps not importing trainers);
``closedloop train --help`` lists them from the registry. Bad input (unknown trainer, unknown key,
invalid value) exits with code 2; a Ctrl-C that saved a checkpoint exits with 130.

Everything the run will touch is checked before a model loads, each problem as one ``error:`` line:
the config's values (finite numbers), the model directory, the output directory (by writing a probe
there), the checkpoint to resume, the metric sinks' packages, the dataset and the run store, which
is opened here (so a file that is not a store, a locked or too new one, fails now, not after the
model is loaded). A run whose loss turns NaN or infinite stops with exit code 1, its store run
``failed`` with the reason, and no model saved from the bad step.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from closedloop import plugins

GROUP = "closedloop.trainers"


def register(sub: argparse._SubParsersAction) -> None:
    trainers = plugins.registry(GROUP)
    listing = "\n".join(f"  {name:<8} {trainers.describe(name)}" for name in trainers.names())
    p = sub.add_parser("train", description="Train with a closedloop trainer; e.g. "
                                            "`closedloop train sft --config sft.yaml --set max_steps=100`.",
                       epilog=f"trainers ({GROUP} entry points):\n{listing}".replace("%", "%%"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trainer", help=f"trainer name: {', '.join(trainers.names())}")
    p.add_argument("--config", "-c", default=None, help="YAML config file (keys of the trainer's config)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (dotted for nested: lora.r=8; values parsed as YAML); repeatable")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--list-keys", action="store_true", help="list every config key with its default and meaning")
    p.set_defaults(func=handle)


def available_trainers() -> list[str]:
    """The registered trainers' names (nothing imported)."""
    return plugins.registry(GROUP).names()


def load_trainer(name: str) -> Any:
    """The trainer module registered as ``name``; ``ValueError`` naming the available ones."""
    trainers = plugins.registry(GROUP)
    try:
        module = trainers.load(name)
    except plugins.PluginNotFound:
        raise ValueError(f"unknown trainer {name!r} (not a trainer: no {GROUP} entry point of that name); "
                         f"available: {', '.join(trainers.names()) or 'none'}") from None
    if not hasattr(module, "CONFIG_CLASS") or not hasattr(module, "run_from_config"):
        raise ValueError(f"{trainers.get(name).target} ({trainers.get(name).source}) is not a trainer "
                         f"(no CONFIG_CLASS / run_from_config); available: {', '.join(trainers.names())}")
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
    except (ValueError, FileNotFoundError, plugins.PluginNotFound) as e:  # bad data found while setting up
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDivergedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    step = getattr(result, "step", None)
    at = f" at step {step}" if step is not None else ""
    if getattr(result, "interrupted", False):
        checkpoint = getattr(result, "checkpoint", None)
        print(f"interrupted{at}{f'; checkpoint {checkpoint}' if checkpoint else ''}. Continue with "
              f"--set resume=auto", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun / accelerate launch only rank 0 reports
        return 0
    print(done_line(result))
    return 0


def done_line(result: Any) -> str:
    """The last line of a training: steps, the final loss/reward, where the model and run went (only
    what the result really holds: a trainer result without a step count says "done", never "? steps")."""
    step = getattr(result, "step", None)
    out = getattr(result, "output_dir", None)
    metrics = getattr(result, "metrics", None) or {}
    summary = " ".join(f"{k}={v:.4g}" for k, v in metrics.items()
                       if k in ("loss", "eval_loss", "reward") and isinstance(v, (int, float)))
    return (f"done: {step} steps" if step is not None else "done") + (f" · {summary}" if summary else "") \
        + (f"; model saved to {out}" if out else "") \
        + (f"; run {result.run_id}" if getattr(result, "run_id", None) else "")
