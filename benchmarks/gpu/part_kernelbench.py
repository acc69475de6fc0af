"""Part ``kernelbench``: the harness's ``cuda`` backend on real KernelBench level-1 problems at
full size (``shipped/problems``, 20 of them, smallest first).

1. **Defaults**: the smallest problem's reference as its own candidate with the harness's default
   configuration (what ``closedloop eval kernelbench --backend cuda --candidate-source reference``
   gets), to show whether the user's path works as shipped.
2. **Self-check**: every problem's ``Model`` judged as its own ``ModelNew``: it must be correct,
   and at 1.0x within the harness's stated +/-25% (or honestly marked ``timing_unstable``).
   Configuration: 4 threads (the judge then credits wall time, which is what GPU work costs,
   and draws the fresh inputs of every call with 4 threads), 2 warm-ups, KernelBench's 5
   correctness trials, 5 timed batches, re-timed once when unstable. As many problems as fit in
   this step's share of the part's time; the others are listed as not reached.
3. **Shipped kernels** (``shipped/kernels.cu``) for problems 88, 40 and 95: the judge's verdict
   (policy strict) and, outside the judge, the kernel's own time with CUDA events as KernelBench
   measures it (``kernel_timing.py``). The extension is built in the background from the start.
4. **Hostile candidates** (``shipped/hostile.py``): each must end with its expected status, and an
   honest candidate judged after them (and after the kernel that never ends) is still correct.

A dry run (no GPU) runs what a CPU allows: the self-check's code on the ``cpu`` backend at 1/64
scale on one problem, the defaults on ``cuda`` (a clear refusal), the static policy on every
candidate, and nvcc on the shipped sources when nvcc is here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import HERE, SHIPPED, Recorder, cuda_ready, part_main
from report import table

sys.path.insert(0, str(SHIPPED))
import candidates  # noqa: E402
import hostile  # noqa: E402

SELF_SHARE, KERNEL_SHARE = 0.42, 0.72  # the self-check ends at 42% of the part's time, the kernels at 72%
TOLERANCE = 0.25  # the self-check's stated tolerance (evals/kernelbench/README.md)
DRY_PROBLEMS = (88,)
DRY_SCALE = 1 / 64


def _summary(r: Any) -> dict[str, Any]:
    """What the report keeps of one verdict."""
    t = r.timings or {}
    return {"status": r.status, "message": (r.message or "")[:400], "speedup": r.speedup, "speedup_ci": r.speedup_ci,
            "timing_unstable": r.timing_unstable, "timing_clock": r.timing_clock,
            "reference_ms": (t.get("reference") or {}).get("median"),
            "candidate_ms": (t.get("candidate") or {}).get("median"), "calls_checked": r.calls_checked,
            "wall_s": (r.sandbox or {}).get("wall_s"), "enforced": (r.sandbox or {}).get("enforced"),
            "traceback_tail": (r.traceback_tail or "")[-600:] or None}


def _within(entry: dict[str, Any]) -> bool:
    return entry["status"] == "correct" and (entry["timing_unstable"] or abs((entry["speedup"] or 0) - 1) <= TOLERANCE)


def _config(cache: Path, **kw: Any) -> Any:
    from closedloop.evals.kernelbench.evaluate import KernelEvalConfig
    from closedloop.sandbox import SandboxLimits

    base: dict[str, Any] = dict(backend="cuda", cache_dir=str(cache), threads=4, warmup=2, trials=5, iters=5,
                                compile_workers=4, limits=SandboxLimits(wall_s=90, cpu_s=900, memory_mb=16384,
                                                                         processes=512, file_size_mb=4096,
                                                                         open_files=1024))
    base.update(kw)
    return KernelEvalConfig(**base)


def _bytes(problem: Any) -> float:
    """Bytes of one call's inputs and outputs at full size, found without allocating them (the
    problem's own code on torch's meta device); a problem meta tensors cannot run comes last."""
    import torch

    mod: dict[str, Any] = {}
    try:
        exec(compile(problem.code, problem.name, "exec"), mod)  # noqa: S102 - KernelBench's own problem file
        with torch.device("meta"):
            inputs = mod["get_inputs"]()
            out = mod["Model"](*mod["get_init_inputs"]())(*inputs)
    except Exception:  # noqa: BLE001
        return float("inf")
    leaves = list(inputs) + (list(out) if isinstance(out, (list, tuple)) else [out])
    return float(sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)))


def _problems() -> list[Any]:
    """The shipped problems, cheapest first (each call draws fresh inputs on the CPU and copies
    them to the device and back, so time goes with bytes)."""
    from closedloop.evals.kernelbench.problems import load_problems

    return sorted(load_problems(SHIPPED / "problems", level=1), key=lambda p: (_bytes(p), p.problem_id))


async def _defaults(problem: Any, cache: Path, slots: Any = None) -> dict[str, Any]:
    """The problem's reference as its own candidate under the harness's default configuration."""
    from closedloop.evals.kernelbench.evaluate import KernelEvalConfig, KernelEvaluator

    ev = KernelEvaluator(KernelEvalConfig(backend="cuda", cache_dir=str(cache)), slots=slots)
    return _summary(await ev.aevaluate_reference(problem))


def _nvcc(rec: Recorder, work: Path) -> None:
    """The shipped CUDA sources through nvcc for the GPU's architecture (sm_90 when there is no
    GPU to ask): syntax, registers, spills; no torch needed, so this runs on any machine with nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        rec.skip("nvcc", "nvcc is not installed here")
        return
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0").split(";")[0].replace(".", "").replace("+PTX", "")
    out = {}
    for stem in ("kernels", "hostile_kit"):
        cmd = [nvcc, "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v", "-c",
               str(SHIPPED / f"{stem}.cu"), "-o", str(work / f"{stem}.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        log = proc.stdout + proc.stderr
        out[stem] = {"ok": proc.returncode == 0, "spills": "spill stores" in log and " 0 bytes spill stores" not in log,
                     "log_tail": log[-800:] if proc.returncode else None}
    rec.set("nvcc", out)


# ------------------------------------------------------------------ dry run
def dry_run(rec: Recorder, args: argparse.Namespace, why: str) -> str:
    from closedloop.evals.kernelbench.evaluate import KernelEvaluator
    from closedloop.evals.kernelbench.policy import check_policy

    cache = args.work / "kernel-cache"
    probs = {p.problem_id: p for p in _problems()}
    rec.set("problems", sorted(probs))
    defaults = asyncio.run(_defaults(probs[DRY_PROBLEMS[0]], cache))
    rec.set("defaults", defaults)
    ev = KernelEvaluator(_config(cache, backend="cpu", scale=DRY_SCALE, threads=1, trials=2, iters=3, warmup=1))
    rows = []
    self_check: dict[str, Any] = {}
    for pid in DRY_PROBLEMS:
        entry = _summary(asyncio.run(ev.aevaluate_reference(probs[pid])))
        entry["within_tolerance"] = _within(entry)
        self_check[probs[pid].key] = entry
        rec.set("self_check", self_check)
        rows.append([probs[pid].key, entry["status"], entry["speedup"], entry["timing_clock"]])
    rec.note(f"dry run: the self-check ran on the cpu backend at scale 1/{round(1 / DRY_SCALE)} ({why})")
    policy = {f"cuda {pid}": check_policy(candidates.cuda_candidate(pid), "cuda", "strict").summary() or "passes"
              for pid in candidates.KERNEL_PROBLEMS}
    policy.update({f"hostile {n}": sorted({v.rule for v in check_policy(c, "cuda", "lenient").violations})
                   for n, c in hostile.ATTACKS.items()})
    rec.set("policy", policy)
    _nvcc(rec, args.work)
    for key in ("kernels", "kernel_events", "hostile"):
        rec.skip(key, f"{why}: CUDA candidates are built and run on a GPU only")
    rec.summary(table(["problem (cpu backend, 1/64)", "status", "speedup", "clock"], rows)
                + ["", f"Defaults on `cuda`: {defaults['status']}: {defaults['message'][:200]}"])
    return "ok" if all(e["status"] == "correct" for e in self_check.values()) else "failed"


# ------------------------------------------------------------------ on a GPU
class GpuRun:
    def __init__(self, rec: Recorder, args: argparse.Namespace):
        from closedloop.evals.harness.runner import ResourceSlots
        from closedloop.evals.kernelbench.evaluate import KernelEvaluator

        self.rec, self.args = rec, args
        self.cache = args.work / "kernel-cache"
        slots = ResourceSlots({"gpu0": 1})  # one timing at a time, across the three evaluators
        self.judge = KernelEvaluator(_config(self.cache), slots=slots)  # policy strict, the default
        self.hostile = KernelEvaluator(_config(self.cache, policy="off", trials=2, iters=4, warmup=1), slots=slots)
        self.start = time.monotonic()
        self.total = rec.remaining()

    def until(self, share: float) -> float:
        return self.start + share * self.total

    async def build(self) -> dict[str, Any]:
        """The shipped extension and the hostile kit, built from the start (two builds side by side)."""
        from closedloop.evals.kernelbench.problems import load_problems

        kernel_problems = {p.problem_id: p for p in _problems() if p.problem_id in candidates.KERNEL_PROBLEMS}
        relu = load_problems(hostile.PROBLEM)[0]

        async def kernels() -> list[Any]:
            out = []
            for pid in candidates.KERNEL_PROBLEMS:  # one after another: the first builds, the others hit the cache
                out.append(await self.judge.acompile(kernel_problems[pid], candidates.cuda_candidate(pid)))
            return out

        t0 = time.monotonic()
        built, kit = await asyncio.gather(kernels(), self.hostile.acompile(relu, hostile.HONEST))
        info = {"kernels": [{"status": r.status, "message": r.message[:300], "compiler_log": (r.compiler_log or "")[-1500:]
                             or None, "builds": r.builds} for r in built],
                "hostile_kit": {"status": kit.status, "message": kit.message[:300],
                                "compiler_log": (kit.compiler_log or "")[-1500:] or None},
                "wall_s": round(time.monotonic() - t0, 1)}
        self.rec.set("builds", info)
        return info

    async def self_check(self, problems: list[Any]) -> None:
        done: dict[str, Any] = {}
        for problem in problems:
            if time.monotonic() > self.until(SELF_SHARE):
                break
            entry = _summary(await self.judge.aevaluate_reference(problem))
            entry["within_tolerance"] = _within(entry)
            done[problem.key] = entry
            self.rec.set("self_check", done)
        left = [p.key for p in problems if p.key not in done]
        if left:
            self.rec.skip("self_check_not_reached", f"the step's time ran out before {len(left)} problems: {left}")

    async def kernels(self, build: asyncio.Task) -> None:
        from closedloop.evals.kernelbench.problems import load_problems

        try:
            await asyncio.wait_for(asyncio.shield(build), max(1.0, self.until(KERNEL_SHARE) - time.monotonic()))
        except asyncio.TimeoutError:
            self.rec.skip("kernels", "the extension's build did not finish in this step's time")
            return
        out: dict[str, Any] = {}
        for pid, stem in candidates.KERNEL_PROBLEMS.items():
            if time.monotonic() > self.until(KERNEL_SHARE):
                self.rec.skip(f"kernel_{pid}", "the step's time ran out")
                continue
            problem = load_problems(candidates.problem_file(pid))[0]
            code = candidates.cuda_candidate(pid)
            entry = _summary(await self.judge.aevaluate(problem, code))
            entry["events"] = await asyncio.to_thread(self._events, pid, code)
            out[stem] = entry
            self.rec.set("kernels", out)

    def _events(self, pid: int, code: str) -> dict[str, Any]:
        """The kernel's own time with CUDA events (``kernel_timing.py``, a process of its own),
        loading the libraries the judge's build made."""
        extensions = self.judge._prebuilt(code)  # the judge's own map: key -> verified library
        if extensions is None:
            return {"error": "not in the build cache"}
        spec = self.args.work / f"extensions_{pid}.json"
        spec.write_text(json.dumps({"extensions": extensions, "settings": self.judge.settings}))
        cand = self.args.work / f"{pid}_cuda.py"
        cand.write_text(code)
        out = self.args.work / f"events_{pid}.json"
        cmd = [sys.executable, str(HERE / "kernel_timing.py"), "--problem", str(candidates.problem_file(pid)),
               "--candidate", str(cand), "--extensions", str(spec), "--out", str(out), "--timer", "events"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, self.rec.remaining() - 5))
        if proc.returncode != 0:
            return {"error": (proc.stdout + proc.stderr)[-1500:]}
        return json.loads(out.read_text())

    async def attacks(self) -> None:
        from closedloop.evals.kernelbench.problems import load_problems
        from closedloop.sandbox import SandboxLimits

        relu = load_problems(hostile.PROBLEM)[0]
        out: dict[str, Any] = {}
        for name, code in hostile.ATTACKS.items():
            wall = 20.0 if name == "kernel_that_never_ends" else 60.0
            if self.rec.remaining() < wall + 40:  # room for it and the honest candidate after it
                self.rec.skip(f"hostile_{name}", "the part's time ran out")
                continue
            ev = self.hostile
            if name == "kernel_that_never_ends":
                from closedloop.evals.kernelbench.evaluate import KernelEvaluator

                cfg = self.hostile.config.model_copy(update={"limits": SandboxLimits(wall_s=wall, cpu_s=900,
                                                                                     memory_mb=16384, processes=512,
                                                                                     file_size_mb=4096, open_files=1024)})
                ev = KernelEvaluator(cfg, slots=self.hostile.slots)
            r = await ev.aevaluate(relu, code)
            entry = _summary(r)
            entry.update(expected=list(hostile.EXPECTED[name]), credited_speedup=r.credited_speedup,
                         contained=hostile.contained(name, r.status, r.credited_speedup))
            out[name] = entry
            self.rec.set("hostile", out)
        honest = await self.hostile.aevaluate(relu, hostile.HONEST)
        self.rec.set("honest_after_hostile", _summary(honest))

    async def run(self) -> str:
        problems = _problems()
        build = asyncio.create_task(self.build())
        self.rec.set("defaults", await _defaults(problems[0], self.cache, self.judge.slots))
        await self.self_check(problems)
        await self.kernels(build)
        await self.attacks()
        if not build.done():
            build.cancel()
        return self.verdict()

    def verdict(self) -> str:
        res = self.rec.data["results"]
        checks = res.get("self_check", {})
        kernels = res.get("kernels", {})
        attacks = res.get("hostile", {})
        rows = [[k, e["status"], e["speedup"], e["timing_clock"], "yes" if e["within_tolerance"] else "NO"]
                for k, e in checks.items()]
        lines = [f"Self-check: {sum(e['within_tolerance'] for e in checks.values())} of {len(checks)} problems correct "
                 f"at 1.0x within +/-{TOLERANCE:.0%} (or marked unstable).", ""]
        lines += table(["problem", "status", "speedup", "clock", "within"], rows)
        lines += ["", "Shipped CUDA kernels (judge, then CUDA events outside the judge):", ""]
        lines += table(["problem", "judge", "judge speedup", "events: reference ms", "kernel ms", "events speedup"],
                       [[k, e["status"], e["speedup"], e["events"].get("reference_ms"), e["events"].get("candidate_ms"),
                         e["events"].get("speedup")] for k, e in kernels.items()])
        lines += ["", "Hostile candidates:", ""]
        lines += table(["attack", "status", "expected", "contained"],
                       [[k, e["status"], "/".join(e["expected"]), "yes" if e["contained"] else "NO"]
                        for k, e in attacks.items()])
        honest = res.get("honest_after_hostile")
        if honest:
            lines += ["", f"Honest candidate after the attacks: {honest['status']}."]
        defaults = res.get("defaults")
        if defaults:
            lines += ["", f"Defaults (smallest problem, the harness's default config): {defaults['status']} "
                          f"{defaults['message'][:200]}"]
        self.rec.summary(lines)
        good = (checks and all(e["within_tolerance"] for e in checks.values())
                and kernels and all(e["status"] == "correct" and e["events"].get("correct") for e in kernels.values())
                and attacks and all(e["contained"] for e in attacks.values())
                and honest is not None and honest["status"] == "correct")
        return "ok" if good else "failed"


def run(rec: Recorder, args: argparse.Namespace) -> str:
    ok, why = cuda_ready()
    if not ok:
        return dry_run(rec, args, why)
    import torch

    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")  # build for this GPU only (faster, its own ISA)
    rec.note(f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}, CUDA_HOME={os.environ.get('CUDA_HOME')}")
    _nvcc(rec, args.work)
    return asyncio.run(GpuRun(rec, args).run())


if __name__ == "__main__":
    part_main("kernelbench", run)
