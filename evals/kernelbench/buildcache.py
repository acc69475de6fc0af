"""The kernel build cache: written only by the trusted builder, verified on every load.

A candidate's ``load_inline`` calls are *described* first (:class:`ExtensionSpec`: name,
sources, options), by running the candidate once in a sandbox whose ``load_inline`` only records
(``serve.extract_specs``). Each spec is then built by :func:`build` in a sandbox of its own that
runs no candidate Python, only the compiler on the spec's sources; the parent hashes the built
library and publishes it under ``<cache>/<key>/`` with a record of that hash. The key hashes the
spec and the build settings (torch, Python, platform, compiler and its version).

Why it cannot be poisoned: candidate code never runs where the cache is writable (sandboxes are
confined by Landlock to their own directories; the builder's staging directory is private and
only the requested key is taken from it), the published artifact is re-hashed before each load
and a mismatch is thrown away and rebuilt, and the cache directory must belong to this user and
be writable by nobody else. Without Landlock, a candidate running as the same user could rewrite
the cache and its records together: the evaluation notes say when Landlock was missing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

MAX_SOURCE_BYTES = 4 << 20
MAX_SPECS = 8
#: load_inline arguments that do not change the built library (dropped from the key).
IGNORED_OPTIONS = ("build_directory", "verbose")


class CacheError(ValueError):
    """The cache directory is unsafe (owned by someone else, writable by others, a symlink)."""


class ExtensionSpec(BaseModel):
    """One ``load_inline`` call, normalised: what the trusted builder builds."""

    name: str
    cpp_sources: list[str] = Field(default_factory=list)
    cuda_sources: list[str] = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", v):
            raise ValueError("an extension name must be a Python identifier of at most 64 characters")
        return v

    def size(self) -> int:
        return sum(len(s) for s in self.cpp_sources + self.cuda_sources) + len(json.dumps(self.options, default=str))


def spec_from_call(load_inline: Any, args: tuple, kwargs: dict[str, Any]) -> ExtensionSpec:
    """Normalise a ``load_inline(*args, **kwargs)`` call (runs where torch is imported)."""
    bound = inspect.signature(load_inline).bind(*args, **kwargs)
    params = dict(bound.arguments)

    def as_list(v: Any) -> list[str]:
        if v is None:
            return []
        return [v] if isinstance(v, str) else [str(x) for x in v]

    name = params.pop("name")
    cpp, cuda = as_list(params.pop("cpp_sources", None)), as_list(params.pop("cuda_sources", None))
    options = {k: v for k, v in params.items() if k not in IGNORED_OPTIONS}
    options = json.loads(json.dumps(options, default=str))
    return ExtensionSpec(name=str(name), cpp_sources=cpp, cuda_sources=cuda, options=options)


@functools.lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "unknown"


def build_settings(backend: str) -> dict[str, str]:
    """What besides the sources decides the built library (part of every key)."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    return {"torch": torch_version, "python": sys.version.split()[0], "platform": f"{sys.platform}-{platform.machine()}",
            "cxx": cxx, "cxx_version": _compiler_version(cxx), "backend": backend,
            "cuda_arch": os.environ.get("TORCH_CUDA_ARCH_LIST", "")}


def extension_key(spec: ExtensionSpec, settings: dict[str, str]) -> str:
    material = json.dumps({"spec": spec.model_dump(mode="json"), "settings": settings}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) or check an existing one: a real directory of this user that
    nobody else can write to. Raises :class:`CacheError` with what is wrong."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"kernel cache {path} is not a plain directory")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CacheError(f"kernel cache {path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o022:
        raise CacheError(f"kernel cache {path} is writable by group or others (mode {oct(st.st_mode & 0o777)}); "
                         "use a private directory (chmod 700)")
    return path


class BuildCache:
    """``<root>/<key>/<name>.so`` with ``<root>/<key>/artifact.json`` (its hash, written last), and
    ``<root>/candidates/<hash>.json``: which keys a candidate's source needs. Only the parent
    writes here."""

    def __init__(self, root: Path):
        self.root = ensure_private_dir(root)

    def _dir(self, key: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", key):
            raise ValueError(f"not a build key: {key!r}")
        return self.root / key

    def artifact(self, key: str) -> Path | None:
        """The verified library for ``key``, or None. A library whose hash no longer matches its
        record is removed (so it is rebuilt), never loaded."""
        d = self._dir(key)
        try:
            record = json.loads((d / "artifact.json").read_text())
            lib = d / record["file"]
            if lib.parent != d or _sha256(lib) != record["sha256"]:
                raise ValueError("hash mismatch")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            shutil.rmtree(d, ignore_errors=True)
            return None
        return lib

    def publish(self, key: str, built: Path) -> Path:
        """Copy a library the trusted builder made into the cache (atomically) and record its hash."""
        d = self._dir(key)
        existing = self.artifact(key)
        if existing is not None:
            return existing
        tmp = self.root / f".{key}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        tmp.mkdir(mode=0o700)
        try:
            shutil.copy2(built, tmp / built.name)
            digest = _sha256(tmp / built.name)
            (tmp / "artifact.json").write_text(json.dumps({"file": built.name, "sha256": digest}))
            shutil.rmtree(d, ignore_errors=True)
            os.rename(tmp, d)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            found = self.artifact(key)  # a concurrent publisher won the race
            if found is None:
                raise
            return found
        return d / built.name

    def _memo(self, code_key: str) -> Path:
        return self.root / "candidates" / f"{code_key}.json"

    def needed(self, code_key: str) -> list[str] | None:
        try:
            keys = json.loads(self._memo(code_key).read_text())["builds"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return [str(k) for k in keys] if isinstance(keys, list) else None

    def remember(self, code_key: str, keys: list[str]) -> None:
        p = self._memo(code_key)
        p.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"builds": keys}))
        os.replace(tmp, p)


def build(spec: dict[str, Any], staging: str) -> dict[str, Any]:
    """Sandbox target of the trusted builder: compile one spec into ``staging`` (no candidate
    Python runs here; the library is loaded once by ``load_inline`` itself). Returns the library's
    file name, or the compiler's log."""
    from torch.utils import cpp_extension

    s = ExtensionSpec.model_validate(spec)
    t0 = time.perf_counter()
    try:
        cpp_extension.load_inline(s.name, s.cpp_sources, s.cuda_sources or None, build_directory=staging,
                                  verbose=False, **s.options)
    except Exception as exc:  # noqa: BLE001 - a failed build is a result
        text = str(exc)
        return {"ok": False, "log": text if len(text) <= 4000 else "..." + text[-4000:]}
    lib = Path(staging) / f"{s.name}.so"
    if not lib.is_file():
        return {"ok": False, "log": f"the build produced no {lib.name}"}
    return {"ok": True, "file": lib.name, "build_s": time.perf_counter() - t0}
