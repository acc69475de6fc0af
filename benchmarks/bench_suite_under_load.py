"""The test suite (or a part of it) under an artificial CPU load: does it still pass?

CI machines and laptops run tests at load 10-16; a test that races a sleep or a timeout against
work passes on an idle machine and fails there. This script starts ``--busy-per-core`` spinning
processes per core (default 2, so load ≈ 2 × cores on top of the tests), runs pytest beside them,
and reports what passed and failed, the wall time, the CPU time of pytest and every process it
waited for (all threads: ``RUSAGE_CHILDREN``), and the 1-minute load average sampled every second.
With ``--compare`` the same tests run first without the load, so the slowdown is a ratio measured
in one invocation.

    python benchmarks/bench_suite_under_load.py                              # the whole suite
    python benchmarks/bench_suite_under_load.py -- tests/trainers -x         # a subset, pytest options
    python benchmarks/bench_suite_under_load.py --busy-per-core 4 --compare --json out.json -- tests/core

The spinners are ordinary processes at normal priority that stop on their own when this script
dies, however it dies (each checks its parent pid), so no load outlives a killed benchmark.
Exit status: pytest's, under load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Spins until its parent (this script) is gone; checks about every million iterations.
SPIN = """
import os
parent = os.getppid()
n = 0
while True:
    n += 1
    if not n & 0xFFFFF and os.getppid() != parent:
        break
"""


@dataclass
class Outcome:
    """One pytest run: counts from its JUnit report, times, and the load around it."""

    label: str
    busy_processes: int
    returncode: int
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    failing: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    load_before: float = 0.0
    load_mean: float = 0.0
    load_max: float = 0.0


def cores() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Load:
    """``n`` spinning processes, started on enter and stopped (and reaped) on exit."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> "Load":
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL) for _ in range(self.n)]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


class LoadSampler:
    """The 1-minute load average, sampled every ``every_s`` seconds in a thread."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every_s)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def read_junit(path: Path) -> tuple[int, int, int, int, list[str]]:
    """(passed, failed, errors, skipped, ids of failed or erroring tests) from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = failed = errors = skipped = 0
    failing = []
    for suite in suites:
        total += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0))
        errors += int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failing.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    return total - failed - errors - skipped, failed, errors, skipped, failing


def run_pytest(label: str, busy: int, pytest_args: list[str]) -> Outcome:
    """pytest in a child process beside ``busy`` spinners; its CPU is the children's rusage delta,
    read after pytest is reaped and before the spinners are (so theirs is not counted)."""
    with tempfile.TemporaryDirectory(prefix="bench-suite-") as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={report}", *pytest_args]
        load_before = os.getloadavg()[0]
        with Load(busy), LoadSampler() as sampler:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            rc = subprocess.call(cmd, cwd=REPO)
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        out = Outcome(label, busy, rc, wall_s=wall, cpu_s=cpu, load_before=load_before,
                      load_mean=statistics.fmean(sampler.samples or [0.0]), load_max=max(sampler.samples or [0.0]))
        if report.is_file():
            out.passed, out.failed, out.errors, out.skipped, out.failing = read_junit(report)
        return out


def describe(o: Outcome) -> str:
    lines = [f"{o.label}: {o.passed} passed, {o.failed} failed, {o.errors} errors, {o.skipped} skipped "
             f"(pytest exit {o.returncode}); wall {o.wall_s:.1f} s, CPU {o.cpu_s:.1f} s "
             f"(pytest and what it waited for); 1-min load average {o.load_before:.1f} before, {o.load_mean:.1f} "
             f"mean / {o.load_max:.1f} max during"]
    lines += [f"  FAILED {t}" for t in o.failing]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="arguments after -- go to pytest (default: the whole suite)")
    parser.add_argument("--busy-per-core", type=int, default=2, help="spinning processes per core (default 2)")
    parser.add_argument("--compare", action="store_true", help="first run the same tests without the load")
    parser.add_argument("--json", type=Path, help="also write the outcomes to this JSON file")
    args, pytest_args = parser.parse_known_args(argv)
    if pytest_args and pytest_args[0] == "--":
        pytest_args = pytest_args[1:]
    if args.busy_per_core < 0:
        parser.error("--busy-per-core must be >= 0")
    n = args.busy_per_core * cores()
    print(f"{cores()} cores, {n} busy processes; pytest {' '.join(pytest_args) or '(whole suite)'}", flush=True)
    outcomes = []
    if args.compare:
        outcomes.append(run_pytest("without added load", 0, pytest_args))
        print(describe(outcomes[-1]), flush=True)
    outcomes.append(run_pytest(f"with {n} busy processes", n, pytest_args))
    print(describe(outcomes[-1]), flush=True)
    if args.compare:
        plain, loaded = outcomes
        print(f"with / without added load: wall {loaded.wall_s / max(plain.wall_s, 1e-9):.2f}x, "
              f"CPU {loaded.cpu_s / max(plain.cpu_s, 1e-9):.2f}x")
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))
    return outcomes[-1].returncode


if __name__ == "__main__":
    sys.exit(main())
