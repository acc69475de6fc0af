"""Arrays and files travel between tools and models as paths to artifacts; small ones inline.

A model cannot paste a 10^6-entry array into a tool call, and a tool result that size would
swamp the context. So tools take an :data:`ArrayInput` (a path to ``.npy``/``.npz``/
``.safetensors``, or a small nested list) and return :class:`ArrayRef` for large outputs.

Paths resolve inside the working root (:mod:`closedloop.paths`). An array's size is read from its
header before any data is: a 2 MB ``.npz`` that would unpack to gigabytes is refused, not
unpacked (limit ``$CLOSEDLOOP_MAX_ARRAY_MB``, default 1024). Saved artifacts are kept under a
size budget (``$CLOSEDLOOP_ARTIFACTS_MAX_MB``, default 5120) that holds even for a burst of
writers: every write reserves its size first (:func:`write_artifact`), removes the oldest artifacts
(older than ten minutes) to make room, and is refused when younger files fill the budget;
:func:`prune_artifacts` also removes by age, like ``closedloop runs prune`` does for runs.
"""

from __future__ import annotations

import math
import os
import time
import uuid
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Union

import numpy as np
from pydantic import BaseModel

# Outputs with at most this many elements are returned inline as lists.
INLINE_LIMIT = 64

ArrayInput = Union[str, list[Any], float, int]


class ArrayRef(BaseModel):
    """A reference to an array saved on disk."""

    path: str
    shape: list[int]
    dtype: str
    key: str | None = None


__all__ = ["ArrayInput", "ArrayRef", "ArtifactError", "artifact_dir", "load_array", "save_array", "array_output",
           "check_array_file", "resolve_array_path", "max_array_bytes", "prune_artifacts", "PruneReport", "INLINE_LIMIT",
           "write_artifact"]


class ArtifactError(ValueError):
    """An artifact is missing, unreadable, malformed or holds non-finite values."""


def artifact_dir() -> Path:
    """Where tool outputs are written: $CLOSEDLOOP_ARTIFACTS, else $CLOSEDLOOP_HOME/artifacts
    (``~/.closedloop/artifacts``); the same rule as :class:`closedloop.config.Settings`."""
    from closedloop.config import get_settings

    root = get_settings().artifacts_dir
    root.mkdir(parents=True, exist_ok=True)
    return root


def _env_mb(var: str, default: float) -> float:
    raw = os.environ.get(var, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ArtifactError(f"{var}={raw!r}: give a size in MB") from None
    if not (value > 0 and math.isfinite(value)):
        raise ArtifactError(f"{var}={raw!r}: give a size in MB (> 0)")
    return value


def max_array_bytes() -> int:
    """The largest array a path may unpack to: ``$CLOSEDLOOP_MAX_ARRAY_MB`` (default 1024)."""
    return int(_env_mb("CLOSEDLOOP_MAX_ARRAY_MB", 1024) * 2**20)


def resolve_array_path(value: str, name: str = "array") -> Path:
    """A path argument resolved inside the working root (see :mod:`closedloop.paths`)."""
    from closedloop.paths import PathOutsideRoot, resolve_path

    try:
        return resolve_path(value, name=name)
    except PathOutsideRoot as e:
        raise ArtifactError(str(e)) from None


def _npy_header_bytes(fh: Any) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
    else:
        shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
    return shape, dtype


def _check_size(name: str, path: Path, what: str, shape: Any, dtype: np.dtype, limit: int) -> None:
    n = math.prod(int(d) for d in shape) * max(int(dtype.itemsize), 1)
    if dtype.hasobject:
        raise ArtifactError(f"{name}: {path.name}{what} holds Python objects; only numeric arrays are read")
    if n > limit:
        raise ArtifactError(f"{name}: {path.name}{what} would unpack to {n / 2**20:.0f} MiB (shape {list(shape)}, "
                            f"{dtype}), over the limit of {limit / 2**20:.0f} MiB (CLOSEDLOOP_MAX_ARRAY_MB)")


def check_array_file(path: Path, *, name: str = "array", key: str | None = None, limit: int | None = None) -> None:
    """Refuse a file whose arrays would unpack beyond ``limit`` bytes, reading only headers."""
    limit = max_array_bytes() if limit is None else limit
    if path.suffix == ".npy":
        with open(path, "rb") as fh:
            shape, dtype = _npy_header_bytes(fh)
        _check_size(name, path, "", shape, dtype, limit)
    elif path.suffix == ".npz":
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                member = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                if key is not None and member != key:
                    continue
                if info.file_size > limit + 4096:  # the zip's own size record
                    raise ArtifactError(f"{name}: {path.name}[{member}] would unpack to "
                                        f"{info.file_size / 2**20:.0f} MiB, over the limit of "
                                        f"{limit / 2**20:.0f} MiB (CLOSEDLOOP_MAX_ARRAY_MB)")
                with zf.open(info) as fh:
                    shape, dtype = _npy_header_bytes(fh)
                _check_size(name, path, f"[{member}]", shape, dtype, limit)
    elif path.suffix == ".safetensors":
        if path.stat().st_size > limit + 2**20:
            raise ArtifactError(f"{name}: {path.name} is {path.stat().st_size / 2**20:.0f} MiB, over the limit of "
                                f"{limit / 2**20:.0f} MiB (CLOSEDLOOP_MAX_ARRAY_MB)")


def load_array(value: ArrayInput, *, key: str | None = None, name: str = "array",
               require_finite: bool = True) -> np.ndarray:
    """Load a path (``.npy``, ``.npz``[key], ``.safetensors``[key]) or an inline list as an array.

    A path must lie inside the working root; its arrays' sizes are checked from their headers
    before anything is unpacked."""
    if isinstance(value, str):
        path = resolve_array_path(value, name)
        if not path.is_file():
            raise ArtifactError(f"{name}: file not found: {value}")
        try:
            if path.suffix in (".npy", ".npz", ".safetensors"):
                check_array_file(path, name=name, key=key)
            if path.suffix == ".npy":
                arr = np.load(path, allow_pickle=False)
            elif path.suffix == ".npz":
                with np.load(path, allow_pickle=False) as z:
                    keys = list(z.keys())
                    k = key or (keys[0] if len(keys) == 1 else None)
                    if k is None or k not in z:
                        raise ArtifactError(f"{name}: {path} holds {keys}; name one with a key")
                    arr = z[k]
            elif path.suffix == ".safetensors":
                from safetensors.numpy import load_file

                tensors = load_file(str(path))
                k = key or (next(iter(tensors)) if len(tensors) == 1 else None)
                if k is None or k not in tensors:
                    raise ArtifactError(f"{name}: {path} holds {sorted(tensors)}; name one with a key")
                arr = tensors[k]
            else:
                raise ArtifactError(f"{name}: unsupported file type {path.suffix!r} (use .npy, .npz or .safetensors)")
        except ArtifactError:
            raise
        except Exception as e:
            raise ArtifactError(f"{name}: cannot read {path}: {e}") from None
    else:
        try:
            arr = np.asarray(value, dtype=float)
        except (ValueError, TypeError) as e:
            raise ArtifactError(f"{name}: inline value is not a rectangular numeric array: {e}") from None
    if require_finite and arr.dtype.kind in "fc" and not np.all(np.isfinite(arr)):
        raise ArtifactError(f"{name}: contains NaN or infinite values")
    return arr


def save_array(arr: Any, *, prefix: str = "array") -> ArrayRef:
    """Save ``arr`` as a ``.npy`` artifact (under the size budget, see :func:`write_artifact`)."""
    arr = np.asarray(arr)
    path = write_artifact(prefix, ".npy", lambda f: np.save(f, arr, allow_pickle=False),
                          reserve_bytes=arr.nbytes + _NPY_HEADER_MAX)
    return ArrayRef(path=str(path), shape=list(arr.shape), dtype=str(arr.dtype))


# An upper bound of a .npy header (numpy pads it to 64 bytes; a few hundred in practice).
_NPY_HEADER_MAX = 4096
# Files younger than this are never removed by the size budget: a run may still hand them on.
MIN_AGE_S = 600.0
_LOCK_NAME = ".budget.lock"  # dot files are neither counted nor pruned


def write_artifact(prefix: str, suffix: str, write: Callable[[BinaryIO], None], *, reserve_bytes: int) -> Path:
    """Write a new artifact with ``write(file)`` and return its path, keeping the directory under
    its size budget (``$CLOSEDLOOP_ARTIFACTS_MAX_MB``) even for a burst of writers.

    ``reserve_bytes`` (an upper bound of the file's size) is reserved before anything is written,
    under a lock that every writer of the directory takes, processes included (sandboxed tools
    write here too): the file is created at that size, so the next writer counts it while it is
    being filled. When the directory cannot hold it, the oldest artifacts older than ten minutes
    are removed; if that is not enough, the write is refused with :class:`ArtifactError` (younger
    files are kept: a run may still hand them on). A file that outgrew its reservation is
    checked against the budget once more before it is kept. Each write scans the directory (one
    ``stat`` per file), the price of a budget that holds across processes.
    """
    directory = artifact_dir()
    budget = _budget_bytes()
    reserve_bytes = max(0, int(reserve_bytes))
    path = directory / f"{prefix}-{uuid.uuid4().hex[:12]}{suffix}"
    partial = path.with_name(f"{path.stem}.partial{suffix}")  # counted while written; never handed out
    with _budget_lock(directory):
        _make_room(directory, reserve_bytes, budget)
        fh = open(partial, "w+b")
        fh.truncate(reserve_bytes)  # the reservation: sparse, but counted at this size
    try:
        with fh:
            write(fh)
            fh.truncate(fh.tell())
        # The rename is under the lock too: a directory scan that runs while an entry is renamed
        # may see neither name (readdir on a changing directory), and would count room that is taken.
        with _budget_lock(directory):
            if partial.stat().st_size > reserve_bytes:
                used = _usage(directory)
                if used > budget:
                    raise ArtifactError(_full_message(used - partial.stat().st_size, partial.stat().st_size, budget))
            os.replace(partial, path)  # never leave a half-written artifact behind
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def _budget_bytes() -> int:
    return int(_env_mb("CLOSEDLOOP_ARTIFACTS_MAX_MB", 5120) * 2**20)


@contextmanager
def _budget_lock(directory: Path) -> Iterator[None]:
    """Exclusive across threads and processes (``flock`` on a lock file in the directory)."""
    import fcntl

    with open(directory / _LOCK_NAME, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _files(directory: Path) -> list[tuple[float, int, Path]]:
    """(mtime, size, path) of the directory's artifacts (dot files excluded), oldest first."""
    files = []
    with os.scandir(directory) as it:
        for entry in it:
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    files.append((st.st_mtime, st.st_size, Path(entry.path)))
            except OSError:
                continue
    files.sort()
    return files


def _usage(directory: Path) -> int:
    return sum(size for _, size, _ in _files(directory))


def _make_room(directory: Path, need: int, budget: int) -> None:
    used = _usage(directory)
    if used + need <= budget:
        return
    if need <= budget:
        used = prune_artifacts(max_total_mb=(budget - need) / 2**20, directory=directory).kept_bytes
    if used + need > budget:
        raise ArtifactError(_full_message(used, need, budget))


def _full_message(used: int, need: int, budget: int) -> str:
    if need > budget:
        return (f"this output needs {need / 2**20:.1f} MiB, more than the artifacts directory's whole budget of "
                f"{budget / 2**20:.0f} MiB (CLOSEDLOOP_ARTIFACTS_MAX_MB); ask for a smaller output")
    return (f"the artifacts directory cannot take this output: it needs {need / 2**20:.1f} MiB and the directory "
            f"holds {used / 2**20:.1f} MiB of its {budget / 2**20:.0f} MiB budget (CLOSEDLOOP_ARTIFACTS_MAX_MB) in "
            f"files younger than {MIN_AGE_S / 60:.0f} minutes, which are kept; ask for a smaller output, or try "
            f"again later")


@dataclass
class PruneReport:
    """What :func:`prune_artifacts` removed and what it kept."""

    removed: int
    freed_bytes: int
    kept: int
    kept_bytes: int


def prune_artifacts(*, older_than: timedelta | None = None, max_total_mb: float | None = None,
                    directory: Path | None = None, min_age_s: float = MIN_AGE_S,
                    dry_run: bool = False) -> PruneReport:
    """Remove artifacts older than ``older_than``, then the oldest ones until the directory holds
    at most ``max_total_mb`` (files younger than ``min_age_s`` are kept either way)."""
    directory = directory or artifact_dir()
    now = time.time()
    files = _files(directory)
    total = sum(f[1] for f in files)
    removed = freed = 0
    budget = None if max_total_mb is None else max_total_mb * 2**20
    for mtime, size, p in files:
        age = now - mtime
        if age < min_age_s:
            continue
        too_old = older_than is not None and age > older_than.total_seconds()
        over = budget is not None and total > budget
        if not (too_old or over):
            continue
        if not dry_run:
            try:
                p.unlink()
            except OSError:
                continue
        removed, freed, total = removed + 1, freed + size, total - size
    return PruneReport(removed=removed, freed_bytes=freed, kept=len(files) - removed, kept_bytes=total)


def array_output(arr: Any, *, prefix: str = "array", inline_limit: int = INLINE_LIMIT) -> Any:
    """Small arrays inline (as lists), large ones saved and returned as an :class:`ArrayRef`."""
    arr = np.asarray(arr)
    if math.prod(arr.shape) <= inline_limit:
        return arr.tolist()
    return save_array(arr, prefix=prefix)
