"""Arrays and files travel between tools and models as paths to artifacts; small ones inline.

A model cannot paste a 10^6-entry array into a tool call, and a tool result that size would
swamp the context. So tools take an :data:`ArrayInput` (a path to ``.npy``/``.npz``/
``.safetensors``, or a small nested list) and return :class:`ArrayRef` for large outputs.
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path
from typing import Any, Union

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


class ArtifactError(ValueError):
    """An artifact is missing, unreadable, malformed or holds non-finite values."""


def artifact_dir() -> Path:
    """Where tool outputs are written: $CLOSEDLOOP_ARTIFACTS or ~/.closedloop/artifacts."""
    root = Path(os.environ.get("CLOSEDLOOP_ARTIFACTS", Path.home() / ".closedloop" / "artifacts"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def load_array(value: ArrayInput, *, key: str | None = None, name: str = "array",
               require_finite: bool = True) -> np.ndarray:
    """Load a path (``.npy``, ``.npz``[key], ``.safetensors``[key]) or an inline list as an array."""
    if isinstance(value, str):
        path = Path(value).expanduser()
        if not path.exists():
            raise ArtifactError(f"{name}: file not found: {path}")
        try:
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


def save_array(arr: Any, *, prefix: str = "array", directory: Path | None = None) -> ArrayRef:
    arr = np.asarray(arr)
    directory = directory or artifact_dir()
    path = directory / f"{prefix}-{uuid.uuid4().hex[:12]}.npy"
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)  # never leave a half-written artifact behind
    return ArrayRef(path=str(path), shape=list(arr.shape), dtype=str(arr.dtype))


def array_output(arr: Any, *, prefix: str = "array", inline_limit: int = INLINE_LIMIT) -> Any:
    """Small arrays inline (as lists), large ones saved and returned as an :class:`ArrayRef`."""
    arr = np.asarray(arr)
    if math.prod(arr.shape) <= inline_limit:
        return arr.tolist()
    return save_array(arr, prefix=prefix)
