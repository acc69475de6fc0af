"""Checks that a training run's paths and sinks are usable, made before any work starts.

A run that loads a model, trains for an hour and then finds that its ``output_dir`` is a file, its
store path is ``/etc/passwd`` or wandb is not installed has wasted the hour; one that saves into
``/proc/self`` fails only at its first checkpoint. Each check here looks at the real thing instead
of guessing from the path's spelling: the output directory is probed by creating (and removing) a
directory with a file in it where the run will write, a store file is checked as the store checks
it, a model directory must hold a ``config.json`` and weights. Every function raises
``ValueError`` with one line that names the path and what is wrong with it; the config validators
(:mod:`closedloop.trainers.config`) turn it into a field error.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["check_model_dir", "check_output_dir", "check_resume", "check_sinks", "check_store_file",
           "check_dataset_path"]

_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
# The package each optional metrics sink imports, and how to install it.
_SINK_PACKAGES = {"wandb": ("wandb", "pip install wandb"), "trackio": ("trackio", "pip install trackio"),
                  "tensorboard": ("tensorboard", "pip install 'closedloop[tensorboard]'")}


def check_model_dir(path: str, what: str = "model") -> None:
    """``path`` is a local Hugging Face model directory with weights, or a hub id that can be loaded
    (offline: one already in the local cache); :func:`closedloop.models.locate.locate_checkpoint`
    decides which, so a mistyped local path is "no such directory", never a hub lookup."""
    from closedloop.models.locate import CheckpointNotFoundError, locate_checkpoint

    try:
        located = locate_checkpoint(path, what=what)
    except CheckpointNotFoundError as e:
        raise ValueError(str(e)) from None
    p = Path(located)
    if p.is_dir() and not any(next(p.glob(pattern), None) for pattern in _WEIGHT_PATTERNS):
        raise ValueError(f"{what} {path!r} holds no weights (*.safetensors or *.bin)")


def check_output_dir(path: str) -> None:
    """Where the run writes can hold its directories and files: probed by creating a directory
    with a file in it, in ``path`` itself or, when it does not exist yet, in its nearest existing
    parent (so a failed check leaves nothing behind)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"output_dir {path!r} is a file, not a directory")
    base = p
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"output_dir {path!r} cannot be created: {str(base)!r} is a file")
    try:
        probe = tempfile.mkdtemp(prefix=".closedloop-probe-", dir=base)
        try:
            with open(os.path.join(probe, "probe"), "wb") as f:
                f.write(b"ok")
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as e:
        raise ValueError(f"output_dir {path!r} is not writable: creating a file in {str(base)!r} failed "
                         f"({e.strerror or e})") from None


def check_resume(resume: bool | str, output_dir: str) -> None:
    """``resume`` names a checkpoint that exists (``true``: the latest in ``output_dir``)."""
    from closedloop.trainers.checkpoint import CheckpointError, resolve_resume

    try:
        resolve_resume(resume, output_dir)
    except CheckpointError as e:
        hint = " (resume=auto starts fresh when there is none)" if resume is True else ""
        raise ValueError(f"{e}{hint}") from None


def check_sinks(report_to: list[str]) -> None:
    """Every optional metrics sink's package is installed (the store needs nothing)."""
    for sink in report_to:
        if sink in _SINK_PACKAGES:
            package, install = _SINK_PACKAGES[sink]
            if importlib.util.find_spec(package) is None:
                raise ValueError(f"report_to includes {sink!r} but {package} is not installed: {install}")


def check_store_file(path: str | os.PathLike[str], *, must_exist: bool, what: str = "store") -> None:
    """``path`` is a run store, or, with ``must_exist=False``, a new file in an existing directory:
    the store's own check (:func:`closedloop.store.location.check_store_path`: a directory, a
    device, a file that is not DuckDB, a missing directory are refused) with ``what`` named, before
    DuckDB would raise its own errors mid-run. Opening the store (which ``closedloop train`` also
    does before any model loads) reports locks and schema versions."""
    from closedloop.store.location import check_store_path

    try:
        check_store_path(path, must_exist=must_exist)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def check_dataset_path(path: str) -> None:
    """A dataset file or ``datasets.save_to_disk`` directory that exists."""
    if not Path(path).expanduser().exists():
        raise ValueError(f"dataset {path!r}: no such file or directory")
