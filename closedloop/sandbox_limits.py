"""What a sandboxed call may use (:class:`SandboxLimits`) and what happened to it
(:class:`SandboxResult`): the data of :mod:`closedloop.sandbox`, importable without its machinery."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

__all__ = ["SandboxLimits", "SandboxResult", "Status"]


class SandboxLimits(BaseModel):
    """What the child may use. ``None`` leaves a limit off."""

    wall_s: float = 60.0
    cpu_s: float | None = 60.0
    memory_mb: int | None = 2048  # RLIMIT_AS (virtual address space, not RSS)
    open_files: int | None = 256
    processes: int | None = 64  # tasks (threads count) inside the sandbox's user namespace
    file_size_mb: int | None = 64
    output_bytes: int = 64_000
    result_bytes: int = 16_000_000  # the JSON result is refused beyond this
    network: bool = False
    env: dict[str, str] = Field(default_factory=dict)  # extra variables kept in the scrubbed environment
    writable_paths: list[str] = Field(default_factory=list)  # besides its own directory (e.g. a build cache)
    python_path: list[str] | None = None  # the child's sys.path; default: the caller's
    threads: int = 1  # OMP_NUM_THREADS and friends


Status = Literal["ok", "error", "timeout", "killed", "crashed", "memory_exceeded"]


class SandboxResult(BaseModel):
    """What happened. ``value`` is the target's JSON return value when ``status == "ok"``."""

    status: Status
    value: Any = None
    error_type: str | None = None
    error_message: str | None = None
    traceback_tail: str | None = None
    returncode: int | None = None
    signal: str | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float | None = None
    max_rss_mb: float | None = None
    enforced: dict[str, bool] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"
