"""KernelBench evaluation time before and after the judge's separation (issue 25).

Per-problem evaluation time on KernelBench level-1 problems at scale 1/64, cold (empty build
cache: each problem's candidate builds its own extension) and warm (every build cached), for this
checkout ("after") and another checkout of closedloop ("before", ``--before DIR``: e.g. a
worktree of main without the change), interleaved in one run (before, after, then after, before,
...). Each measurement runs in a fresh interpreter (the package imported from that checkout) and
reports its wall time, its CPU time with every thread and process counted (its own, the fork
server's and every sandbox's, read from the fork server's /proc accounting, which includes its
reaped children), and the load average around it.

The candidate for each problem is the problem's own ``Model`` whose output goes through a small
C++ copy kernel (a real ``load_inline`` extension), judged with the policy off (it computes with
torch) and each version's default settings. Warm runs share one extension source across
problems (one build per version, made before the measurement); cold runs give each problem a
source of its own. Problems that fail at the scale (sizes scaled below a kernel's size) are
reported and left out of the figures.

    python benchmarks/bench_kernelbench_judge.py --problems KernelBench/KernelBench --before ../main
    python benchmarks/bench_kernelbench_judge.py --problems DIR --ids 1 19 50 --cold 2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_IDS = [1, 4, 19, 23, 33, 40, 42, 47, 50, 57, 67, 88, 89, 94, 95, 97]
FOLDERS = ["agents", "tools", "graphs", "trainers", "memory", "evals"]  # mapped as closedloop.<folder> (setup.py)

COPY = r'''
#include <torch/extension.h>
#include <cstring>
// TAG
torch::Tensor copy_out(torch::Tensor x) {
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    std::memcpy(out.data_ptr(), xc.data_ptr(), xc.numel() * xc.element_size());
    return out;
}
'''


def candidate_code(problem_code: str, tag: str) -> str:
    src = COPY.replace("TAG", tag)
    return (problem_code + "\n\nfrom torch.utils.cpp_extension import load_inline as _load_inline\n"
            f"_copy = _load_inline(name='bench_copy_{tag}', cpp_sources=r'''{src}''', functions=['copy_out'], "
            "extra_cflags=['-O2'])\n\n\nclass ModelNew(Model):\n    def forward(self, *args):\n"
            "        out = super().forward(*args)\n"
            "        return _copy.copy_out(out) if isinstance(out, torch.Tensor) else out\n")


def overlay(checkout: Path, into: Path) -> Path:
    """A package root where ``closedloop`` is ``checkout``'s: its ``closedloop/`` entries plus the
    top-level folders as subpackages (what setup.py maps), all as symlinks."""
    pkg = into / "closedloop"
    pkg.mkdir(parents=True)
    for entry in (checkout / "closedloop").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for folder in FOLDERS:
        if (checkout / folder).is_dir():
            (pkg / folder).symlink_to(checkout / folder)
    return into


# ---------------------------------------------------------------- one measurement (a subprocess)
def _zygote_cpu_s() -> float:
    from closedloop import sandbox

    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for server in list(sandbox._SERVERS.values()):
        try:
            fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
        except OSError:
            pass
    return total


def _own_cpu_s() -> float:
    ru, rc = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime + rc.ru_utime + rc.ru_stime


def worker(spec: dict) -> dict:
    import asyncio

    from closedloop.evals.kernelbench.evaluate import KernelEvalConfig, KernelEvaluator
    from closedloop.evals.kernelbench.problems import load_problems, scale_source

    problems = {p.problem_id: p for p in load_problems(spec["problems"], level=1, ids=spec["ids"])}
    cfg = KernelEvalConfig(cache_dir=spec["cache"], scale=spec["scale"], policy="off", compile_workers=1)
    ev = KernelEvaluator(cfg)
    codes = {pid: candidate_code(scale_source(p.code, spec["scale"])[0], f"p{pid}" if spec["phase"] == "cold"
                                 else "shared") for pid, p in problems.items()}

    async def go() -> list[dict]:
        if spec["phase"] == "warm":  # builds (and the fork server's start) are not what is measured
            for pid, p in problems.items():
                await ev.acompile(p, codes[pid])
        out = []
        for pid, p in problems.items():
            cpu0, zyg0, t0 = _own_cpu_s(), _zygote_cpu_s(), time.perf_counter()
            r = await ev.aevaluate(p, codes[pid])
            wall = time.perf_counter() - t0
            out.append({"id": pid, "status": r.status, "wall_s": wall, "message": r.message[:200],
                        "cpu_s": (_own_cpu_s() - cpu0) + (_zygote_cpu_s() - zyg0)})
        return out

    rows = asyncio.run(go())
    return {"rows": rows}


# ---------------------------------------------------------------- the comparison
def measure(label: str, root: Path, spec: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root)
    env.setdefault("OMP_NUM_THREADS", "1")
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True,
                          text=True, cwd=root)
    if proc.returncode != 0:
        raise SystemExit(f"{label} {spec['phase']} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(label=label, phase=spec["phase"], wall_s=time.perf_counter() - t0,
               load=(load0 + os.getloadavg()[0]) / 2)
    return out


def summary(runs: list[dict], label: str, phase: str, ok: set[int]) -> dict:
    rows = [r for run in runs if run["label"] == label and run["phase"] == phase for r in run["rows"] if r["id"] in ok]
    return {"n": len(rows), "median_wall_s": statistics.median(r["wall_s"] for r in rows),
            "mean_wall_s": statistics.mean(r["wall_s"] for r in rows),
            "mean_cpu_s": statistics.mean(r["cpu_s"] for r in rows),
            "load": statistics.mean(run["load"] for run in runs if run["label"] == label and run["phase"] == phase)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--problems", help="a KernelBench-layout root with level1/")
    ap.add_argument("--before", help="another closedloop checkout to compare with (its root folder)")
    ap.add_argument("--ids", type=int, nargs="+", default=DEFAULT_IDS)
    ap.add_argument("--cold", type=int, default=3, help="problems measured cold (each builds an extension)")
    ap.add_argument("--rounds", type=int, default=2, help="warm rounds per version (interleaved)")
    ap.add_argument("--scale", type=float, default=1 / 64)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if not args.problems:
        ap.error("--problems is required")
    tmp = Path(tempfile.mkdtemp(prefix="bench-kb-judge-"))
    try:
        here = Path(__file__).resolve().parent.parent
        versions = [("after", overlay(here, tmp / "after"))]
        if args.before:
            versions.insert(0, ("before", overlay(Path(args.before).resolve(), tmp / "before")))
        base = {"problems": str(Path(args.problems).resolve()), "scale": args.scale}
        runs: list[dict] = []
        caches = {label: tmp / f"cache-{label}" for label, _ in versions}
        for label, root in versions:  # the warm runs' shared extension is built first, off the clock
            caches[label].mkdir(mode=0o700)
        for rnd in range(args.rounds):
            for label, root in (versions if rnd % 2 == 0 else versions[::-1]):
                runs.append(measure(label, root, {**base, "phase": "warm", "ids": args.ids, "cache": str(caches[label])}))
                print(f"warm round {rnd + 1} {label}: {runs[-1]['wall_s']:.1f} s (load {runs[-1]['load']:.1f})",
                      flush=True)
        for label, root in (versions if args.rounds % 2 == 0 else versions[::-1]):
            cold = tmp / f"cold-{label}"
            cold.mkdir(mode=0o700)
            runs.append(measure(label, root, {**base, "phase": "cold", "ids": args.ids[:args.cold], "cache": str(cold)}))
            print(f"cold {label}: {runs[-1]['wall_s']:.1f} s (load {runs[-1]['load']:.1f})", flush=True)
        statuses = {(run["label"], r["id"]): r["status"] for run in runs for r in run["rows"]}
        ok = {pid for pid in args.ids if all(statuses.get((label, pid)) == "correct" for label, _ in versions
                                            if (label, pid) in statuses)}
        failed = sorted({(k, s) for k, s in statuses.items() if k[1] not in ok}, key=str)
        if failed:
            print("left out (not correct in every version at this scale):",
                  ", ".join(f"{label} {pid}: {s}" for (label, pid), s in failed))
        print(f"\nper-problem evaluation at scale {args.scale:g}, {len(ok)} problems "
              f"({os.cpu_count()} CPUs); CPU counts every thread and process")
        table = {}
        for phase in ("warm", "cold"):
            for label, _ in versions:
                s = table[(label, phase)] = summary(runs, label, phase, ok)
                print(f"  {phase:4s} {label:6s}: median {s['median_wall_s']:.3f} s/problem wall, mean "
                      f"{s['mean_wall_s']:.3f} s wall, {s['mean_cpu_s']:.3f} s CPU (n={s['n']}, load {s['load']:.1f})")
        if args.before:
            for phase in ("warm", "cold"):
                a, b = table[("after", phase)], table[("before", phase)]
                print(f"  {phase}: after/before {a['median_wall_s'] / b['median_wall_s']:.2f}x wall (median), "
                      f"{a['mean_cpu_s'] / b['mean_cpu_s']:.2f}x CPU (mean)"
                      + ("; goal <= 1.5x warm: " + ("met" if a["median_wall_s"] <= 1.5 * b["median_wall_s"] else "NOT met")
                         if phase == "warm" else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
