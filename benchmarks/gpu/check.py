"""The GPU check (issue 32): every part in turn, each in a process of its own with a hard deadline,
written into one JSON + markdown report after every part.

    bash scripts/gpu_check.sh --out DIR                  # on a machine with an NVIDIA GPU (<= 8 minutes)
    bash scripts/gpu_check.sh --dry-run --out DIR        # the same script on a CPU, tiny sizes (CI)
    bash scripts/gpu_check.sh --parts kernelbench,egg_profile --out DIR   # re-run some parts

Why a process per part with a deadline: a lent GPU machine is held for minutes, so one part that
hangs (a server that never comes up, a kernel that never ends) must cost its own time only. The
part writes its record after every result (``common.Recorder``); when it is killed, the report
keeps what it had written and says where it stopped. Why the report is rewritten after every
part: if the whole command is cut short, what is on disk is still a complete report of the parts
that ran. What each part measures: its docstring; how to run the check: README.md, "The GPU check".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import HERE, REPO, normalise
from report import render_markdown

GRACE_S = 5.0  # beyond a part's own deadline, before it is killed (it closes its record itself first)
LOG_TAIL = 4000
LOG_CAP = 200_000  # bytes of one part's log kept in log.txt


@dataclass(frozen=True)
class Part:
    name: str
    script: str
    gpu_s: float  # its own deadline on the GPU machine (the run's budget caps them together)
    dry_s: float  # its deadline in a dry run (generous: CI machines are loaded; the deadline is not tested there)
    what: str


PARTS = (
    Part("env", "part_env.py", 20, 120, "the machine: GPU, driver, CUDA, torch, Triton, nvcc, ncu; copy and matmul ceilings"),
    Part("model", "part_model.py", 40, 240, "a Qwen2-0.5B-shaped model with random weights, built here (bf16)"),
    Part("kernelbench", "part_kernelbench.py", 190, 600,
         "the cuda backend: reference self-check, three shipped kernels, hostile candidates"),
    Part("triton", "part_triton.py", 25, 240, "three hand-written Triton kernels: correctness and do_bench timing"),
    Part("egg_profile", "part_egg.py", 30, 240, "Nsight Compute on one kernel, through EGG's profile step"),
    Part("training", "part_training.py", 100, 600, "SFT tokens/s and GRPO step time vs TRL, bf16, peak memory"),
    Part("serving", "part_serving.py", 75, 600, "closedloop serve vs transformers serve --continuous-batching"),
)
DEFAULT_BUDGET_S = 420.0  # of the 8 minutes: the rest is the wheels' install, the graces and the report
STOP_S = 10.0  # _stop's longest wait for one part (SIGTERM, then SIGKILL)
COMMAND_LIMIT_S = 600.0  # one command on the device machine (the wheels' install included)
INSTALL_S = 45.0  # the wheels and closedloop into a folder on PYTHONPATH (scripts/gpu_check.sh), offline


def plan(budget_s: float = DEFAULT_BUDGET_S) -> dict[str, Any]:
    """What a GPU run will do and its worst case: every part at its deadline, killed after its
    grace. The worst case must end inside one device command, with room for the wheels' install."""
    worst = budget_s + len(PARTS) * (GRACE_S + STOP_S)
    return {"parts": [{"name": x.name, "gpu_s": x.gpu_s, "dry_s": x.dry_s, "what": x.what} for x in PARTS],
            "budget_s": budget_s, "worst_case_s": worst, "command_limit_s": COMMAND_LIMIT_S,
            "install_s": INSTALL_S,
            "fits": INSTALL_S + worst <= COMMAND_LIMIT_S, "outputs": ["report.json", "report.md", "log.txt"]}


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _stop(proc: subprocess.Popen) -> None:
    """End a part and everything it started in its process group (servers, compilers)."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - n))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_part(part: Part, deadline_s: float, args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run one part to its end or its deadline; its record, with wall and CPU time added."""
    pdir = work / "parts" / part.name
    shutil.rmtree(pdir, ignore_errors=True)
    pdir.mkdir(parents=True)
    log = work / "logs" / f"{part.name}.log"
    cmd = [sys.executable, str(HERE / part.script), "--out", str(pdir), "--work", str(work),
           "--deadline-s", f"{deadline_s:.1f}"] + (["--dry-run"] if args.dry_run else [])
    cpu0, t0 = _child_cpu(), time.monotonic()
    timed_out = False
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(REPO), start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=deadline_s + GRACE_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
            rc = proc.returncode
        finally:
            _stop(proc)  # what the part left running in its group (a server it failed to stop)
    wall, cpu = time.monotonic() - t0, _child_cpu() - cpu0
    try:
        record = json.loads((pdir / "part.json").read_text())
    except (OSError, ValueError):
        record = {"part": part.name, "status": "error", "results": {}, "skipped": {}, "notes": [],
                  "error": "the part left no record (it died before writing one)"}
    if timed_out:
        record["status"] = "timeout"
        record["error"] = (f"killed at its deadline ({deadline_s:.0f} s + {GRACE_S:.0f} s grace); the results are "
                           "those it had written")
    elif record.get("status") == "running":
        record["status"] = "error"
        record["error"] = f"exited with code {rc} before closing its record"
    record.update(what=part.what, deadline_s=round(deadline_s, 1), wall_s=round(wall, 2), cpu_s=round(cpu, 2),
                  exit_code=rc)
    if record["status"] not in ("ok", "skipped"):
        record["log_tail"] = _tail(log, LOG_TAIL)
    return record


def _wheel_check(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every distribution a part imported must be in the device machine's image or carried as a
    wheel: checked on every run, the dry run included, so the wheel list cannot rot."""
    from wheels import carried, image_packages

    available = image_packages() | {normalise(n) for n, _ in carried()} | {"closedloop"}
    wheels = {normalise(n) for n, _ in carried()}
    modules: dict[str, list[str]] = {}
    for rec in parts.values():
        modules.update(rec.get("imported_distributions") or {})
    used = sorted({d for owners in modules.values() for d in owners})
    missing = sorted({"/".join(owners) for owners in modules.values() if not set(owners) & available})
    return {"imported": used, "from_wheels": [d for d in used if d in wheels], "missing": missing}


def write_report(out: Path, report: dict[str, Any], work: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("report.json", json.dumps(report, indent=1, default=str)),
                       ("report.md", render_markdown(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)
    with open(out / ".log.txt.tmp", "w") as fh:
        for name in report["parts"]:
            fh.write(f"===== {name} =====\n{_tail(work / 'logs' / f'{name}.log', LOG_CAP)}\n")
    os.replace(out / ".log.txt.tmp", out / "log.txt")


def part_env(work: Path, dry_run: bool) -> dict[str, str]:
    """The parts' environment: offline, unbuffered, caches under the run's folder, CUDA's compiler
    named (the sandboxes' scrubbed environment keeps CUDA_HOME and TORCH_CUDA_ARCH_LIST)."""
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_OFFLINE="1", CLOSEDLOOP_KERNEL_CACHE=str(work / "kernel-cache"),
               TRITON_CACHE_DIR=str(work / "triton-cache"), CLOSEDLOOP_STORE=str(work / "runs.duckdb"))
    nvcc = shutil.which("nvcc")
    if nvcc and "CUDA_HOME" not in env:
        env["CUDA_HOME"] = str(Path(os.path.realpath(nvcc)).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                          else []))
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="on CPU with tiny sizes: every part's code path, as far as "
                                                          "a CPU allows (what cannot run says why)")
    p.add_argument("--out", type=Path, default=REPO / "out" / "gpu_check", help="report.json, report.md, log.txt")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--parts", default=None, help=f"comma-separated, in this order: {','.join(x.name for x in PARTS)}")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"all parts together (default {DEFAULT_BUDGET_S:.0f} on a GPU; none in a dry run)")
    p.add_argument("--plan", action="store_true", help="print the plan and its worst case as JSON, run nothing")
    args = p.parse_args(argv)
    wanted = [x.strip() for x in args.parts.split(",")] if args.parts else [x.name for x in PARTS]
    unknown = sorted(set(wanted) - {x.name for x in PARTS})
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {[x.name for x in PARTS]}")
    if {"training", "serving"} & set(wanted):
        wanted.append("model")  # they train and serve its checkpoint, built in this run's scratch folder
    if args.plan:
        out = plan(args.budget_s if args.budget_s is not None else DEFAULT_BUDGET_S)
        out["runs"] = [x.name for x in PARTS if x.name in wanted]
        print(json.dumps(out, indent=1))
        return 0
    budget = args.budget_s if args.budget_s is not None else (None if args.dry_run else DEFAULT_BUDGET_S)
    tmp = None
    work = args.work
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="gpu-check-")
        work = Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    env = part_env(work, args.dry_run)
    report: dict[str, Any] = {"check": "closedloop GPU check (issue 32)", "dry_run": args.dry_run,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "budget_s": budget,
                              "load_at_start": list(os.getloadavg()), "parts": {}}
    start = time.monotonic()
    try:
        for part in (x for x in PARTS if x.name in wanted):
            cap = part.dry_s if args.dry_run else part.gpu_s
            if budget is not None:
                left = budget - (time.monotonic() - start)
                if left < min(cap, 10.0):
                    report["parts"][part.name] = {"part": part.name, "status": "not_run", "what": part.what,
                                                  "results": {}, "skipped": {}, "notes": [],
                                                  "error": f"not run: {left:.0f} s of the budget left"}
                    write_report(args.out, report, work)
                    continue
                cap = min(cap, left)
            print(f"[gpu-check] {part.name}: up to {cap:.0f} s", flush=True)
            report["parts"][part.name] = run_part(part, cap, args, work, env)
            rec = report["parts"][part.name]
            print(f"[gpu-check] {part.name}: {rec['status']} in {rec['wall_s']:.1f} s (CPU {rec['cpu_s']:.1f} s)",
                  flush=True)
            report["elapsed_s"] = round(time.monotonic() - start, 1)
            write_report(args.out, report, work)
        report["wheels"] = _wheel_check(report["parts"])
        report["load_at_end"] = list(os.getloadavg())
        report["elapsed_s"] = round(time.monotonic() - start, 1)
        report["cpu_s"] = round(sum(r.get("cpu_s", 0.0) for r in report["parts"].values()), 2)
        write_report(args.out, report, work)
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"[gpu-check] report: {args.out / 'report.md'}", flush=True)
    bad = [n for n, r in report["parts"].items() if r["status"] not in ("ok", "skipped")]
    return 1 if bad or report["wheels"]["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
