"""Evaluate candidate kernels against KernelBench problems, each in its own sandbox.

Flow for a batch: static policy (no code runs) → compile every candidate in parallel (one
sandbox each, ``compile_workers`` at a time) → evaluate serially (correctness and timing in
one sandbox per candidate, so timings do not fight over cores). Builds are cached by the
extension's source hash in ``cache_dir``: a candidate whose kernel was built before (by itself
or any other candidate) loads the library without compiling.

Statuses: policy_violation, compile_error, load_error, runtime_error, shape_mismatch,
dtype_mismatch, incorrect, timeout, correct, suspicious (correct but faster than
``suspicious_speedup``: kept out of fast_p until reviewed), and reference_error (the problem
itself failed; not counted against the candidate).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from closedloop.sandbox import SandboxLimits, SandboxResult, arun_sandboxed
from closedloop.evals.harness.runner import ResourceSlots
from closedloop.evals.kernelbench.policy import check_policy
from closedloop.evals.kernelbench.problems import Problem, scale_source

Backend = Literal["cpu", "triton", "cuda"]
STATUSES = ("policy_violation", "compile_error", "load_error", "runtime_error", "shape_mismatch", "dtype_mismatch",
            "incorrect", "timeout", "correct", "suspicious", "reference_error")
_WORKER = "closedloop.evals.kernelbench.worker:run"
_WORKER_MODULE = _WORKER.partition(":")[0]


def default_cache_dir() -> Path:
    root = os.environ.get("CLOSEDLOOP_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "closedloop", "kernels")
    return Path(root)


class KernelEvalConfig(BaseModel):
    """How candidates are judged. Defaults follow KernelBench v0.1 (atol=rtol=1e-2, 5 trials, seed
    42, 3 warm-ups) except the number of timed trials (20 instead of 100: CPU-sized problems)."""

    backend: Backend = "cpu"
    scale: float = 1.0
    policy: Literal["strict", "lenient", "off"] = "strict"
    seed: int = 42
    trials: int = 5
    atol: float = 1e-2
    rtol: float = 1e-2
    warmup: int = 3
    iters: int = 20
    flush_mb: int = 32
    threads: int = 1
    compile_reference: bool = False  # torch.compile reference timing: slow on CPU (inductor builds C++)
    suspicious_speedup: float = 10.0
    recheck: bool = True
    cache_dir: str | None = None
    compile_workers: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1))
    # Fork each sandbox from a server that imported torch and the worker once (saves ~2 s of
    # imports per call). The server never runs candidate code and every child is single-use and
    # gets the same limits and isolation as a fresh interpreter (closedloop/_sandbox_child.py).
    fork_server: bool = True
    compile_wall_s: float = 900.0  # building torch extensions takes minutes on a loaded machine
    limits: SandboxLimits = Field(default_factory=lambda: SandboxLimits(wall_s=180, cpu_s=600, memory_mb=8192,
                                                                         processes=256, file_size_mb=512,
                                                                         open_files=1024))

    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()


class KernelResult(BaseModel):
    """One candidate's verdict, with what an agent needs to fix the code."""

    problem: str
    level: int
    problem_id: int
    sample_id: int = 0
    backend: str
    scale: float
    scaled_constants: dict[str, Any] = Field(default_factory=dict)
    status: str
    message: str = ""
    compiler_log: str | None = None
    traceback_tail: str | None = None
    max_diff: float | None = None
    mean_diff: float | None = None
    speedup: float | None = None
    speedup_vs_compiled: float | None = None
    timings: dict[str, dict[str, float]] = Field(default_factory=dict)
    timed: bool = False
    not_timed_reason: str | None = None
    policy_warnings: list[str] = Field(default_factory=list)
    reference_nondeterministic: bool = False
    builds: list[dict[str, Any]] = Field(default_factory=list)
    sandbox: dict[str, Any] = Field(default_factory=dict)
    profile: dict[str, Any] | None = None
    code_hash: str = ""

    @property
    def correct(self) -> bool:
        return self.status in ("correct", "suspicious")

    def feedback(self) -> dict[str, Any]:
        """The compact JSON an agent reads."""
        keys = ("status", "message", "compiler_log", "traceback_tail", "max_diff", "mean_diff", "speedup",
                "speedup_vs_compiled", "timings", "timed", "not_timed_reason", "policy_warnings", "profile")
        return {k: getattr(self, k) for k in keys if getattr(self, k) not in (None, [], {})}


def backend_available(backend: str) -> tuple[bool, str]:
    """Whether the backend can run here, and if not, why."""
    if backend == "cpu":
        ok = shutil.which("c++") or shutil.which("g++")
        return (bool(ok and shutil.which("ninja")), "" if ok else "needs g++ and ninja")
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return False, ("triton is not installed (pip install 'closedloop[triton]'; correctness runs under "
                           "TRITON_INTERPRET=1 on CPU)")
        return True, ""
    if backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            return False, ("no CUDA device here: CUDA candidates cannot be built with this torch build or run; "
                           "not timed")
        return True, ""
    return False, f"unknown backend {backend!r}"


def _request(problem_code: str, code: str, cfg: KernelEvalConfig, phase: str, staging: str) -> dict[str, Any]:
    return {"problem_code": problem_code, "candidate_code": code, "backend": cfg.backend, "phase": phase,
            "cache_dir": str(cfg.cache_path()), "staging_dir": staging, "seed": cfg.seed, "trials": cfg.trials,
            "atol": cfg.atol, "rtol": cfg.rtol, "warmup": cfg.warmup, "iters": cfg.iters, "flush_mb": cfg.flush_mb,
            "threads": cfg.threads, "compile_reference": cfg.compile_reference, "recheck": cfg.recheck,
            # Triton runs under its CPU interpreter (TRITON_INTERPRET=1): correct, but its speed
            # says nothing about the kernel, so it is not timed
            "timing": cfg.backend != "triton"}


def _publish(staging: Path, cache: Path) -> None:
    """Move finished builds from a sandbox's private staging directory into the shared cache."""
    if not staging.exists():
        return
    for d in staging.iterdir():
        if d.is_dir() and (d / "ok").exists() and not (cache / d.name).exists():
            tmp = cache / f".{d.name}.{os.getpid()}.tmp"
            try:
                shutil.copytree(d, tmp, ignore=shutil.ignore_patterns("*.o", "*.ninja*", "build.ninja"))
                os.replace(tmp, cache / d.name)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)


def _sandbox_info(res: SandboxResult) -> dict[str, Any]:
    return {"status": res.status, "wall_s": round(res.wall_s, 3), "cpu_s": res.cpu_s, "max_rss_mb": res.max_rss_mb,
            "signal": res.signal, "enforced": res.enforced, "notes": res.notes}


def _limits(cfg: KernelEvalConfig, staging: str) -> SandboxLimits:
    lim = cfg.limits.model_copy(deep=True)
    lim.writable_paths = list(lim.writable_paths) + [staging]
    lim.threads = cfg.threads
    env = dict(lim.env)
    if cfg.backend == "triton":
        env.setdefault("TRITON_INTERPRET", "1")
    for var in ("CXX", "CC", "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST"):
        if var in os.environ:
            env.setdefault(var, os.environ[var])
    lim.env = env
    return lim


class KernelEvaluator:
    """Evaluates candidates for problems under one config (cache, limits, scale, policy)."""

    def __init__(self, config: KernelEvalConfig | None = None, *, slots: ResourceSlots | None = None):
        self.config = config or KernelEvalConfig()
        self.config.cache_path().mkdir(parents=True, exist_ok=True)
        # Builds run in parallel; timing holds the device's one slot (shared across evaluators
        # when the caller passes the same ``slots``), so timings never compete for cores.
        self.slots = slots or ResourceSlots({self.device_slot: 1})
        self._compile_sem = asyncio.Semaphore(max(1, self.config.compile_workers))

    @property
    def device_slot(self) -> str:
        return "cpu-timing" if self.config.backend == "cpu" else "gpu0"

    def _memo_path(self, code: str) -> Path:
        key = hashlib.sha256((self.config.backend + "\0" + code).encode()).hexdigest()[:24]
        return self.config.cache_path() / "candidates" / f"{key}.json"

    def _known_built(self, code: str) -> bool:
        """This exact candidate compiled before and every build it used is still in the cache."""
        try:
            keys = json.loads(self._memo_path(code).read_text())["builds"]
        except (OSError, ValueError, KeyError):
            return False
        return all((self.config.cache_path() / k / "ok").exists() for k in keys)

    def _remember_built(self, code: str, builds: list[dict[str, Any]]) -> None:
        p = self._memo_path(code)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"builds": [b["key"] for b in builds]}))
        os.replace(tmp, p)

    def _base(self, problem: Problem, code: str, sample_id: int) -> tuple[KernelResult, str]:
        scaled, changed = scale_source(problem.code, self.config.scale)
        res = KernelResult(problem=problem.key, level=problem.level, problem_id=problem.problem_id,
                           sample_id=sample_id, backend=self.config.backend, scale=self.config.scale,
                           scaled_constants=changed, status="load_error",
                           code_hash=hashlib.sha256(code.encode()).hexdigest()[:16])
        return res, scaled

    def _precheck(self, res: KernelResult, code: str) -> bool:
        """Policy and backend availability; True when the candidate may run."""
        try:
            compile(code, "candidate.py", "exec")
        except SyntaxError as exc:
            res.status, res.message = "load_error", f"syntax error: {exc.msg} (line {exc.lineno})"
            return False
        if self.config.policy != "off":
            rep = check_policy(code, self.config.backend, self.config.policy)
            res.policy_warnings = [w.message for w in rep.warnings]
            if not rep.ok:
                res.status, res.message = "policy_violation", rep.summary()
                return False
        ok, why = backend_available(self.config.backend)
        if not ok and not (self.config.backend == "cuda"):
            res.status, res.message = "load_error", why
            return False
        if not ok:
            res.status, res.message, res.not_timed_reason = "load_error", why, why
            return False
        return True

    async def _phase(self, problem_code: str, code: str, phase: str) -> tuple[SandboxResult, Path]:
        staging = Path(tempfile.mkdtemp(prefix="closedloop-kbuild-"))
        try:
            limits = _limits(self.config, str(staging))
            if phase == "compile":
                limits.wall_s = max(limits.wall_s, self.config.compile_wall_s)
            res = await arun_sandboxed(_WORKER, _request(problem_code, code, self.config, phase, str(staging)),
                                       limits=limits, preload=[_WORKER_MODULE] if self.config.fork_server else None)
            if res.status == "ok":
                _publish(staging, self.config.cache_path())
            return res, staging
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _fold(self, res: KernelResult, sb: SandboxResult, phase: str) -> None:
        res.sandbox = _sandbox_info(sb)
        if sb.status == "ok":
            out = sb.value or {}
            for key in ("status", "message", "compiler_log", "traceback_tail", "max_diff", "mean_diff", "speedup",
                        "speedup_vs_compiled", "timings", "builds", "profile"):
                if out.get(key) is not None:
                    setattr(res, key, out[key])
            res.reference_nondeterministic = bool(out.get("reference_nondeterministic"))
            if res.status == "compiled":
                return
            res.timed = bool(res.timings)
            # Flag on both the mean (KernelBench's speedup) and the median: one stalled reference
            # iteration on a busy machine inflates the mean, not the median.
            med = res.timings.get("reference", {}).get("median", 0.0) / max(
                res.timings.get("candidate", {}).get("median", 0.0), 1e-9) if res.timings else None
            if res.status == "correct" and res.speedup is not None and res.speedup > self.config.suspicious_speedup \
                    and (med is None or med > self.config.suspicious_speedup):
                res.status = "suspicious"
                res.message += (f"; a speedup of {res.speedup:.3g}x is above {self.config.suspicious_speedup:g}x: "
                                "kept out of fast_p until reviewed")
            return
        where = "while compiling/loading" if phase == "compile" else "while running"
        if sb.status == "timeout" or (sb.status == "killed" and "CPU time" in (sb.error_message or "")):
            res.status, res.message = "timeout", f"timed out {where}: {sb.error_message}"
        else:
            res.status = "load_error" if phase == "compile" else "runtime_error"
            detail = {"crashed": "the process crashed", "killed": "the process was killed",
                      "memory_exceeded": "memory limit exceeded",
                      "error": "the evaluation failed"}.get(sb.status, sb.status)
            res.message = f"{detail} {where}: {sb.error_message or ''}".strip()
            res.traceback_tail = sb.traceback_tail or (sb.stderr[-2000:] if sb.stderr else None)

    async def acompile(self, problem: Problem, code: str, sample_id: int = 0) -> KernelResult:
        """Policy + build (+ load) only. Status "compiled" when it built."""
        res, scaled = self._base(problem, code, sample_id)
        if not self._precheck(res, code):
            return res
        async with self._compile_sem:
            sb, _ = await self._phase(scaled, code, "compile")
        self._fold(res, sb, "compile")
        if res.status == "compiled":
            self._remember_built(code, res.builds)
        return res

    async def aevaluate(self, problem: Problem, code: str, sample_id: int = 0, *, profile: bool = False) -> KernelResult:
        """Full evaluation of one candidate: policy, build, correctness, timing, recheck."""
        res, scaled = self._base(problem, code, sample_id)
        if not self._precheck(res, code):
            return res
        built = None
        if not self._known_built(code):  # build first, in parallel with other builds, off the device slot
            built = await self.acompile(problem, code, sample_id)
            if built.status != "compiled":
                return built
        async with self.slots.hold(self.device_slot):
            sb, _ = await self._phase(scaled, code, "profile" if profile else "eval")
        self._fold(res, sb, "eval")
        if built is not None:  # this call built it: report the builds as they happened, not as cache hits
            res.builds = built.builds
            res.sandbox["compile_wall_s"] = built.sandbox.get("wall_s")
        if self.config.backend != "cpu":
            res.timed = False
            res.not_timed_reason = ("not timed: Triton ran under its CPU interpreter (correctness only; timing "
                                    "needs a GPU run)") if self.config.backend == "triton" else None
            if res.not_timed_reason:
                res.speedup = None
                res.timings = {}
        return res

    def evaluate(self, problem: Problem, code: str, sample_id: int = 0, *, profile: bool = False) -> KernelResult:
        """Blocking :meth:`aevaluate` (its own event loop; the evaluator's semaphores are renewed
        for it, since asyncio primitives belong to one loop)."""
        async def go() -> KernelResult:
            self._compile_sem = asyncio.Semaphore(max(1, self.config.compile_workers))
            self.slots = ResourceSlots(self.slots.limits)
            return await self.aevaluate(problem, code, sample_id, profile=profile)

        return asyncio.run(go())

    async def aevaluate_many(self, items: list[tuple[Problem, str, int]], *, progress=None) -> list[KernelResult]:
        """Compile all in parallel (``compile_workers`` at a time), then evaluate serially."""
        built = await asyncio.gather(*(self.acompile(*it) for it in items))
        out: list[KernelResult] = []
        for item, b in zip(items, built):
            if b.status != "compiled":
                out.append(b)
            else:
                out.append(await self.aevaluate(*item))
            if progress is not None:
                progress(out[-1])
        return out


def result_json(res: KernelResult) -> str:
    return json.dumps(res.feedback(), default=str)
