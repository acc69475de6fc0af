"""CPU time of closedloop's listing commands against ``langgraph --help``, in one run.

Each command runs as a fresh process; its CPU time is the user + system time of that child and
every thread it ran (``os.wait4``'s resource usage), so a command that hides work in threads pays
for it. The commands are interleaved (one round runs each once, the starting point rotating each
round), repeated, and reported as medians with wall time and the load average, as ratios against
``langgraph --help`` (the ``langgraph-cli`` of the test extra).

Goals (issue 27): ``closedloop --help`` at most 1.5x and ``closedloop tools`` at most 2x the CPU of
``langgraph --help``.

    python benchmarks/bench_cli_startup.py [--repeats 15] [--before DIR] [--json OUT] [--check]

``--before DIR`` also times another checkout of closedloop (e.g. ``git worktree add DIR <commit>``
with its entry-point metadata generated there, ``python -c "import setuptools; setuptools.setup()"
egg_info``), run as ``python -m closedloop`` from DIR, beside this checkout run the same way, in the
same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = [["--help"], ["tools"], ["graphs"], ["train", "--help"]]
GOALS = {"--help": 1.5, "tools": 2.0}
PEER = "langgraph --help"


@dataclass
class Case:
    label: str
    argv: list[str]
    cwd: str
    env: dict[str, str]
    cpu: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)


def script(name: str) -> str:
    """A console script of this interpreter's environment (beside ``python``), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        sys.exit(f"{name} is not installed (pip install -e '.[test]')")
    return found


def run_once(case: Case) -> None:
    start = time.perf_counter()
    proc = subprocess.Popen(case.argv, cwd=case.cwd, env=case.env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    case.wall.append(time.perf_counter() - start)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stderr.close()
    if proc.returncode != 0:
        sys.exit(f"{case.label} exited {proc.returncode}: {err.decode(errors='replace')[-2000:]}")
    case.cpu.append(usage.ru_utime + usage.ru_stime)


def build_cases(before: Path | None, neutral: str) -> list[Case]:
    env = {**os.environ, "COLUMNS": "200"}
    cases = [Case(PEER, [script("langgraph"), "--help"], neutral, env)]
    closedloop = script("closedloop")
    cases += [Case("closedloop " + " ".join(c), [closedloop, *c], neutral, env) for c in COMMANDS]
    if before is not None:
        for tag, root in (("before", before.resolve()), ("after", REPO)):
            root_env = {**env, "PYTHONPATH": str(root)}
            cases += [Case(f"{tag}: python -m closedloop " + " ".join(c), [sys.executable, "-m", "closedloop", *c],
                           str(root), root_env) for c in COMMANDS]
    return cases


def report(cases: list[Case], rounds: int, load: tuple[list[float], list[float]]) -> dict:
    peer = cases[0]
    peer_cpu = statistics.median(peer.cpu)
    rows = []
    for case in cases:
        paired = statistics.median(c / p for c, p in zip(case.cpu, peer.cpu))
        rows.append({"command": case.label, "cpu_ms": 1000 * statistics.median(case.cpu),
                     "wall_ms": 1000 * statistics.median(case.wall), "cpu_ratio": statistics.median(case.cpu) / peer_cpu,
                     "paired_ratio": paired})
    print(f"{rounds} interleaved rounds; load average {load[0][0]:.2f} before, {load[1][0]:.2f} after "
          f"({os.cpu_count()} CPUs); CPU = user + sys of the child, all threads; medians")
    print(f"{'command':48} {'CPU ms':>8} {'wall ms':>8} {'CPU x peer':>11} {'paired x':>9}  goal")
    verdicts = {}
    for row in rows:
        name = row["command"].removeprefix("closedloop ")
        goal = GOALS.get(name) if row["command"].startswith("closedloop ") else None
        verdict = "" if goal is None else f"<= {goal}x: {'met' if row['cpu_ratio'] <= goal else 'MISSED'}"
        if goal is not None:
            verdicts[name] = row["cpu_ratio"] <= goal
        print(f"{row['command']:48} {row['cpu_ms']:8.0f} {row['wall_ms']:8.0f} {row['cpu_ratio']:11.2f} "
              f"{row['paired_ratio']:9.2f}  {verdict}")
    return {"rounds": rounds, "load_before": load[0], "load_after": load[1], "cpus": os.cpu_count(), "rows": rows,
            "goals_met": verdicts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--before", type=Path, help="another closedloop checkout to time beside this one")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as neutral:  # no checkout's metadata on sys.path by accident
        cases = build_cases(args.before, neutral)
        for case in cases:  # warm-up: page cache and .pyc files, not timed
            run_once(case)
            case.cpu.clear()
            case.wall.clear()
        load_before = list(os.getloadavg())
        for r in range(args.repeats):
            for i in range(len(cases)):
                run_once(cases[(r + i) % len(cases)])
        load_after = list(os.getloadavg())
    result = report(cases, args.repeats, (load_before, load_after))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if args.check and not all(result["goals_met"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
