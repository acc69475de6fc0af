"""Evaluate candidate kernels against KernelBench problems, out of the candidate's reach.

Flow for a candidate: static policy (no code runs) → build step (the candidate's ``load_inline``
calls are recorded in a sandbox, then each is compiled by the trusted builder in a sandbox of its
own and published to the build cache, ``buildcache.py``; ``compile_workers`` builds at a time) →
the judge (``judge.py``): a reference process and a candidate process, both sandboxed, driven call
by call by this process, which compares the outputs and times both sides with its own clock.
Evaluations hold the device's timing slot one at a time, so timings do not fight over cores.

Statuses: policy_violation, compile_error, load_error, runtime_error, shape_mismatch,
dtype_mismatch, incorrect, invalid_output (the candidate process answered what cannot be
accepted: malformed, oversized or too deeply nested), timeout, correct, suspicious (correct but
faster than ``suspicious_speedup``: kept out of fast_p until reviewed), reference_error (the problem
itself failed; not counted against the candidate) and infra_error (the harness failed).

Threat model (what a candidate cannot do, what it can): ``evals/kernelbench/README.md``.
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import traceback
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from closedloop.evals.harness.runner import ResourceSlots
from closedloop.evals.kernelbench.buildcache import (MAX_SOURCE_BYTES, MAX_SPECS, BuildCache, ExtensionSpec,
                                                     build_settings, extension_key)
from closedloop.evals.kernelbench.judge import SERVE_MODULE, JudgeRequest, judge
from closedloop.evals.kernelbench.policy import check_policy
from closedloop.evals.kernelbench.problems import Problem, scale_source
from closedloop.sandbox import SandboxLimits, SandboxResult, arun_sandboxed, owned_tempdir

Backend = Literal["cpu", "triton", "cuda"]
STATUSES = ("policy_violation", "compile_error", "load_error", "runtime_error", "shape_mismatch", "dtype_mismatch",
            "incorrect", "invalid_output", "timeout", "correct", "suspicious", "reference_error", "infra_error")
_EXTRACT = "closedloop.evals.kernelbench.serve:extract_specs"
_BUILD = "closedloop.evals.kernelbench.buildcache:build"


def default_cache_dir() -> Path:
    root = os.environ.get("CLOSEDLOOP_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "closedloop", "kernels")
    return Path(root)


class KernelEvalConfig(BaseModel):
    """How candidates are judged. Defaults follow KernelBench v0.1 (atol=rtol=1e-2, 5 correctness
    trials, weights seeded with 42, 3 warm-ups) except: 20 timed calls instead of 100 (CPU-sized
    problems), every call (timed ones too) checked on fresh inputs, inputs drawn from a secret
    seed (``input_seed=None``; give one to reproduce a run), and the credited speedup is the
    ratio of medians (``speedup_mean``, KernelBench's ratio of means, is kept too)."""

    backend: Backend = "cpu"
    scale: float = 1.0
    policy: Literal["strict", "lenient", "off"] = "strict"
    seed: int = 42  # weights: torch.manual_seed before Model(...) and ModelNew(...), as KernelBench
    input_seed: int | None = None  # None: a fresh secret seed per evaluation (reported afterwards)
    trials: int = 5
    atol: float = 1e-2
    rtol: float = 1e-2
    warmup: int = 3
    iters: int = 20
    threads: int = 1
    compile_reference: bool = False  # torch.compile reference timing: slow on CPU (inductor builds C++)
    suspicious_speedup: float = 10.0
    # A speedup whose 90% interval is wider than +/- this is re-timed once, then marked unstable
    # (no reward may use it; see timing.py).
    max_uncertainty: float = 0.15
    retime: bool = True
    cache_dir: str | None = None
    compile_workers: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1))
    # Fork each sandbox from a server that imported torch and the serving code once (saves ~2 s
    # of imports per sandbox). The server never runs candidate code and every child is single-use
    # and gets the same limits and isolation as a fresh interpreter (closedloop/_sandbox_child.py).
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
    speedup: float | None = None  # median reference time / median candidate time
    speedup_mean: float | None = None  # KernelBench's: mean / mean
    speedup_ci: list[float] | None = None  # ~90% interval of ``speedup``
    speedup_vs_compiled: float | None = None
    timings: dict[str, dict[str, float]] = Field(default_factory=dict)  # ms per call
    timing_clock: str | None = None  # "cpu" (the process's CPU time, one thread) or "wall" (more threads)
    timed: bool = False
    timing_unstable: bool = False
    not_timed_reason: str | None = None
    policy_warnings: list[str] = Field(default_factory=list)
    reference_nondeterministic: bool = False
    calls_checked: int = 0
    input_seed: int | None = None
    builds: list[dict[str, Any]] = Field(default_factory=list)
    sandbox: dict[str, Any] = Field(default_factory=dict)
    profile: dict[str, Any] | None = None
    code_hash: str = ""

    @property
    def correct(self) -> bool:
        return self.status in ("correct", "suspicious")

    @property
    def credited_speedup(self) -> float | None:
        """The speedup a reward may use: a correct, timed, stable result's; None otherwise."""
        if self.status != "correct" or not self.timed or self.timing_unstable:
            return None
        return self.speedup

    def feedback(self) -> dict[str, Any]:
        """The compact JSON an agent reads."""
        keys = ("status", "message", "compiler_log", "traceback_tail", "max_diff", "mean_diff", "speedup",
                "speedup_mean", "speedup_ci", "speedup_vs_compiled", "timings", "timed", "timing_unstable", "not_timed_reason",
                "policy_warnings", "profile")
        return {k: getattr(self, k) for k in keys if getattr(self, k) not in (None, [], {}, False)}


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


def _sandbox_info(res: SandboxResult) -> dict[str, Any]:
    return {"status": res.status, "wall_s": round(res.wall_s, 3), "cpu_s": res.cpu_s, "max_rss_mb": res.max_rss_mb,
            "signal": res.signal, "enforced": res.enforced, "notes": res.notes}


#: The sandboxes' allocator and OpenMP settings. Why: glibc returns freed memory to the system and
#: moves its mmap threshold with the process's history, so two processes running the same code
#: could pay page faults in one and not the other; fixed thresholds make the reference's process
#: and the candidate's allocate alike. Idle OpenMP threads sleep instead of spinning (their spin
#: would count as the candidate's CPU outside its turn, and slow the other side down).
SANDBOX_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
               "MALLOC_TOP_PAD_": str(64 << 20), "OMP_WAIT_POLICY": "PASSIVE"}


def cuda_device_nodes() -> list[str]:
    """NVIDIA's device files (``/dev/nvidiactl``, ``/dev/nvidia0``, ``/dev/nvidia-uvm``, ...):
    CUDA opens them read-write, which Landlock refuses unless they are named writable."""
    return sorted(glob.glob("/dev/nvidia*"))


def _limits(cfg: KernelEvalConfig, writable: list[str] | None = None) -> SandboxLimits:
    lim = cfg.limits.model_copy(deep=True)
    lim.writable_paths = list(lim.writable_paths) + list(writable or [])
    if cfg.backend == "cuda":
        # CUDA reserves far more virtual address space than any RLIMIT_AS that would still contain
        # a process (its unified address space spans host and device memory), so the address-space
        # limit is off on this backend (README: what it does not guarantee)
        lim.writable_paths += cuda_device_nodes()
        lim.memory_mb = None
    lim.threads = cfg.threads
    env = {**SANDBOX_ENV, **lim.env}
    if cfg.backend == "triton":
        env.setdefault("TRITON_INTERPRET", "1")
    for var in ("CXX", "CC", "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST"):
        if var in os.environ:
            env.setdefault(var, os.environ[var])
    lim.env = env
    return lim


def reference_candidate(problem_code: str) -> str:
    """A problem's own ``Model`` as its ``ModelNew`` (the harness's self-check: it must come out
    correct, at 1.0x within the timing noise)."""
    return problem_code.rstrip() + "\n\n\nModelNew = Model\n"


class KernelEvaluator:
    """Evaluates candidates for problems under one config (cache, limits, scale, policy)."""

    def __init__(self, config: KernelEvalConfig | None = None, *, slots: ResourceSlots | None = None):
        self.config = config or KernelEvalConfig()
        self.cache = BuildCache(self.config.cache_path())
        self.settings = build_settings(self.config.backend)
        # Builds run in parallel; timing holds the device's one slot (shared across evaluators
        # when the caller passes the same ``slots``), so timings never compete for cores.
        self.slots = slots or ResourceSlots({self.device_slot: 1})
        self._compile_sem = asyncio.Semaphore(max(1, self.config.compile_workers))

    @property
    def device_slot(self) -> str:
        return "cpu-timing" if self.config.backend == "cpu" else "gpu0"

    def _code_key(self, code: str) -> str:
        material = json.dumps([self.config.backend, code, self.settings], sort_keys=True)
        return hashlib.sha256(material.encode()).hexdigest()[:32]

    def _prebuilt(self, code: str) -> dict[str, str] | None:
        """{key: verified library} for every extension this exact candidate needs, or None when
        it was never built or a library is missing or fails its hash check."""
        keys = self.cache.needed(self._code_key(code))
        if keys is None:
            return None
        found = {k: self.cache.artifact(k) for k in keys}
        if any(v is None for v in found.values()):
            return None
        return {k: str(v) for k, v in found.items()}

    def _base(self, problem: Problem, code: str, sample_id: int) -> tuple[KernelResult, str]:
        scaled, changed = scale_source(problem.code, self.config.scale)
        res = KernelResult(problem=problem.key, level=problem.level, problem_id=problem.problem_id,
                           sample_id=sample_id, backend=self.config.backend, scale=self.config.scale,
                           scaled_constants=changed, status="load_error",
                           code_hash=hashlib.sha256(code.encode()).hexdigest()[:16])
        return res, scaled

    def _precheck(self, res: KernelResult, code: str, policy: bool = True) -> bool:
        """Policy and backend availability; True when the candidate may run."""
        try:
            compile(code, "candidate.py", "exec")
        except SyntaxError as exc:
            res.status, res.message = "load_error", f"syntax error: {exc.msg} (line {exc.lineno})"
            return False
        if self.config.policy != "off" and policy:
            rep = check_policy(code, self.config.backend, self.config.policy)
            res.policy_warnings = [w.message for w in rep.warnings]
            if not rep.ok:
                res.status, res.message = "policy_violation", rep.summary()
                return False
        ok, why = backend_available(self.config.backend)
        if not ok:
            res.status, res.message = "load_error", why
            if self.config.backend == "cuda":
                res.not_timed_reason = why
            return False
        return True

    async def _build(self, res: KernelResult, code: str) -> bool:
        """The build step: record the candidate's extensions, build those not in the cache with
        the trusted builder, publish them. False (and ``res`` says why) when it failed."""
        cfg = self.config
        async with self._compile_sem:
            sb = await arun_sandboxed(_EXTRACT, code, limits=_limits(cfg),
                                      preload=[SERVE_MODULE] if cfg.fork_server else None)
        res.sandbox = _sandbox_info(sb)
        if sb.status != "ok":
            _fold_failure(res, sb, "while reading the candidate's extensions")
            return False
        out = sb.value if isinstance(sb.value, dict) else {}
        try:
            raw = out.get("specs", [])
            if not isinstance(raw, list) or len(raw) > MAX_SPECS:
                raise ValueError(f"more than {MAX_SPECS} extensions")
            specs = [ExtensionSpec.model_validate(x) for x in raw]
            if sum(s.size() for s in specs) > MAX_SOURCE_BYTES:
                raise ValueError(f"extension sources over {MAX_SOURCE_BYTES} bytes")
        except ValueError as exc:
            res.status, res.message = "invalid_output", f"the candidate's extensions cannot be built: {str(exc)[:500]}"
            return False
        error = out.get("error") if isinstance(out.get("error"), dict) else None
        if error is not None and not specs:
            res.status, res.message = "load_error", str(error.get("message", ""))[:2000]
            res.traceback_tail = str(error.get("traceback", ""))[-3000:] or None
            return False
        keys = []
        for spec in specs:
            key = extension_key(spec, self.settings)
            keys.append(key)
            if self.cache.artifact(key) is not None:
                res.builds.append({"name": spec.name, "key": key, "cached": True})
                continue
            if not await self._build_one(res, spec, key):
                return False
        self.cache.remember(self._code_key(code), keys)
        return True

    async def _build_one(self, res: KernelResult, spec: ExtensionSpec, key: str) -> bool:
        cfg = self.config
        staging = owned_tempdir("kbuild")
        try:
            limits = _limits(cfg, [str(staging)])
            limits.wall_s = max(limits.wall_s, cfg.compile_wall_s)
            limits.env = {**limits.env, "TORCH_EXTENSIONS_DIR": str(staging)}
            async with self._compile_sem:
                sb = await arun_sandboxed(_BUILD, spec.model_dump(mode="json"), str(staging), limits=limits,
                                          preload=[SERVE_MODULE] if cfg.fork_server else None)
            value = sb.value if isinstance(sb.value, dict) else {}
            if sb.status != "ok":
                _fold_failure(res, sb, f"while building extension {spec.name}")
                return False
            if not value.get("ok"):
                res.status, res.message = "compile_error", f"extension {spec.name} failed to compile"
                res.compiler_log = str(value.get("log", ""))[-4000:]
                return False
            # only the requested library is taken from the staging directory, hashed here
            lib = staging / f"{spec.name}.so"
            if not lib.is_file():
                res.status, res.message = "compile_error", f"extension {spec.name}: the build produced no library"
                return False
            self.cache.publish(key, lib)
            res.builds.append({"name": spec.name, "key": key, "cached": False,
                               "build_s": float(value.get("build_s", 0.0))})
            return True
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def acompile(self, problem: Problem, code: str, sample_id: int = 0) -> KernelResult:
        """Policy + build step only. Status "compiled" when every extension is built."""
        res, _ = self._base(problem, code, sample_id)
        if not self._precheck(res, code):
            return res
        if self._prebuilt(code) is not None:
            res.status, res.message = "compiled", "every extension already in the build cache"
            return res
        if await self._build(res, code):
            res.status, res.message = "compiled", "built"
        return res

    async def aevaluate(self, problem: Problem, code: str, sample_id: int = 0, *, profile: bool = False) -> KernelResult:
        """Full evaluation of one candidate: policy, build, the judge. Never raises for what the
        candidate does; a harness failure is an ``infra_error`` result."""
        return await self._guarded(problem, code, sample_id, profile, False)

    async def aevaluate_reference(self, problem: Problem, sample_id: int = 0) -> KernelResult:
        """The problem's own ``Model`` judged as its ``ModelNew`` (``reference_candidate``): the
        harness's self-check. No policy applies to it (it is the problem's code, not an agent's)."""
        return await self._guarded(problem, reference_candidate(scale_source(problem.code, self.config.scale)[0]),
                                   sample_id, False, True)

    async def _guarded(self, problem: Problem, code: str, sample_id: int, profile: bool,
                       reference_source: bool) -> KernelResult:
        res, scaled = self._base(problem, code, sample_id)
        try:
            return await self._aevaluate(res, scaled, code, profile, reference_source)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every sample gets a verdict
            res.status = "infra_error"
            res.message = f"the harness failed: {type(exc).__name__}: {str(exc)[:1000]}"
            res.traceback_tail = traceback.format_exc()[-3000:]
            return res

    async def _aevaluate(self, res: KernelResult, scaled: str, code: str, profile: bool,
                         reference_source: bool) -> KernelResult:
        cfg = self.config
        if not self._precheck(res, code, policy=not reference_source):
            return res
        extensions = self._prebuilt(code)
        if extensions is None:  # build first, in parallel with other builds, off the device slot
            if not await self._build(res, code):
                return res
            extensions = self._prebuilt(code)
            if extensions is None:
                res.status, res.message = "infra_error", "the build cache lost a fresh build (removed concurrently?)"
                return res
        else:
            res.builds = [{"name": Path(p).stem, "key": k, "cached": True} for k, p in extensions.items()]
        req = JudgeRequest(problem_code=scaled, candidate_code=code, extensions=extensions,
                           build_settings=self.settings, device="cuda" if cfg.backend == "cuda" else "cpu",
                           seed=cfg.seed, input_seed=cfg.input_seed, trials=cfg.trials, warmup=cfg.warmup,
                           iters=cfg.iters, atol=cfg.atol, rtol=cfg.rtol, threads=cfg.threads,
                           # Triton runs under its CPU interpreter (TRITON_INTERPRET=1): correct, but
                           # its speed says nothing about the kernel, so it is not timed
                           timing=cfg.backend != "triton", compile_reference=cfg.compile_reference,
                           profile=profile, max_uncertainty=cfg.max_uncertainty, retime=cfg.retime)
        async with self.slots.hold(self.device_slot):
            out, info = await judge(req, _limits(cfg), fork_server=cfg.fork_server)
        self._fold(res, out, info)
        return res

    def _fold(self, res: KernelResult, out: dict[str, Any], info: dict[str, Any]) -> None:
        compile_wall = res.sandbox.get("wall_s") if res.sandbox else None
        res.sandbox = info
        if compile_wall is not None and any(not b.get("cached") for b in res.builds):
            res.sandbox["compile_wall_s"] = compile_wall
        for key in ("status", "message", "traceback_tail", "max_diff", "mean_diff", "speedup", "speedup_mean",
                    "speedup_ci", "speedup_vs_compiled", "timings", "timing_clock", "profile", "input_seed",
                    "calls_checked"):
            if out.get(key) is not None:
                setattr(res, key, out[key])
        res.reference_nondeterministic = bool(out.get("reference_nondeterministic"))
        res.timing_unstable = bool(out.get("timing_unstable"))
        res.timed = res.status == "correct" and bool(res.timings)
        if res.status != "correct":
            res.speedup = res.speedup_mean = res.speedup_vs_compiled = res.speedup_ci = None
            if res.status not in ("timeout", "runtime_error"):
                res.timings = {}
            return
        if self.config.backend == "triton":
            res.not_timed_reason = ("not timed: Triton ran under its CPU interpreter (correctness only; timing "
                                    "needs a GPU run)")
        if not res.timed:
            res.message = res.message or f"correct on {res.calls_checked} checked calls; not timed"
            return
        note = out.get("timing_note")
        res.message = (f"correct on {res.calls_checked} checked calls; speedup {res.speedup:.3g}x over eager torch "
                       f"(median; mean ratio {res.speedup_mean:.3g}x)" + (f"; {note}" if note else ""))
        if (res.speedup or 0) > self.config.suspicious_speedup and (res.speedup_mean or 0) > self.config.suspicious_speedup:
            res.status = "suspicious"
            res.message += (f"; a speedup of {res.speedup:.3g}x is above {self.config.suspicious_speedup:g}x: "
                            "kept out of fast_p until reviewed")

    def evaluate(self, problem: Problem, code: str, sample_id: int = 0, *, profile: bool = False) -> KernelResult:
        """Blocking :meth:`aevaluate` (its own event loop; the evaluator's semaphores are renewed
        for it, since asyncio primitives belong to one loop)."""
        async def go() -> KernelResult:
            self._compile_sem = asyncio.Semaphore(max(1, self.config.compile_workers))
            self.slots = ResourceSlots(self.slots.limits)
            return await self.aevaluate(problem, code, sample_id, profile=profile)

        return asyncio.run(go())

    async def aevaluate_many(self, items: list[tuple[Problem, str, int]], *, progress=None) -> list[KernelResult]:
        """Build all in parallel (``compile_workers`` at a time), then evaluate one by one. Every
        item gets a result, in order, whatever the others did."""
        built = await asyncio.gather(*(self.acompile(*it) for it in items), return_exceptions=True)
        out: list[KernelResult] = []
        for item, b in zip(items, built):
            if isinstance(b, KernelResult) and b.status != "compiled":
                out.append(b)
            else:
                out.append(await self.aevaluate(*item))
            if progress is not None:
                progress(out[-1])
        return out


def _fold_failure(res: KernelResult, sb: SandboxResult, where: str) -> None:
    """A build-step sandbox that did not return normally."""
    res.sandbox = _sandbox_info(sb)
    if sb.status == "timeout" or (sb.status == "killed" and "CPU time" in (sb.error_message or "")):
        res.status, res.message = "timeout", f"timed out {where}: {sb.error_message}"
        return
    if sb.status == "error" and sb.error_type == "InvalidResult":
        res.status, res.message = "invalid_output", f"{where}: {sb.error_message}"
        return
    res.status = "load_error"
    detail = {"crashed": "the process crashed", "killed": "the process was killed",
              "memory_exceeded": "memory limit exceeded", "error": "the process failed"}.get(sb.status, sb.status)
    res.message = f"{detail} {where}: {sb.error_message or ''}".strip()
    res.traceback_tail = sb.traceback_tail or (sb.stderr[-2000:] if sb.stderr else None)


def result_json(res: KernelResult) -> str:
    return json.dumps(res.feedback(), default=str)
