"""The wheels the device machine needs, and how to fetch them here.

The device machine reaches no package index. Its image holds PyTorch, Triton, transformers and
about two hundred other distributions (``image_packages.txt``); the GPU check needs a few more
(closedloop's own dependencies that the image lacks, and TRL, the trainers' peer). Those are
listed in ``wheels.txt`` at the versions CI tests here, and fetched on this machine as wheels for
the device's Python (3.12, manylinux x86-64), into ``.whl/`` (git-ignored), which travels with
the working tree (64 MiB in all, the tree included):

    python benchmarks/gpu/wheels.py prepare          # or: bash scripts/gpu_check.sh --prepare-wheels

Every run of the check (the dry run in CI too) records which distributions each part imported
and fails when one is in neither the image nor ``wheels.txt``, so the list cannot fall behind
the code. vLLM is not in it: its wheel alone is larger than what a call may carry.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from common import HERE, REPO, normalise

WHEELS = HERE / "wheels.txt"
IMAGE = HERE / "image_packages.txt"
BUDGET_MIB = 48  # of the 64 MiB a call carries; the working tree takes the rest (about 8 MiB)
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64")


def _lines(path: Path) -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines() if ln.split("#", 1)[0].strip()]


def image_packages() -> set[str]:
    return {normalise(n) for n in _lines(IMAGE)}


def carried() -> list[tuple[str, str]]:
    """(name, version) of every wheel to carry, from ``wheels.txt`` (``name==version`` lines)."""
    out = []
    for ln in _lines(WHEELS):
        name, sep, ver = ln.partition("==")
        if not sep or not ver.strip():
            raise ValueError(f"{WHEELS.name}: {ln!r} is not name==version")
        out.append((name.strip(), ver.strip()))
    return out


def prepare(dest: Path) -> int:
    """Download every wheel of ``wheels.txt`` for the device's Python and platform into ``dest``;
    refuse (exit 1) when they add up to more than the budget."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    for name, ver in carried():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
               "--implementation", "cp", *plat, "-d", str(dest), "-q", f"{name}=={ver}"]
        if subprocess.run(cmd).returncode != 0:
            print(f"could not fetch {name}=={ver} for Python {PYTHON} manylinux x86-64", file=sys.stderr)
            return 1
    sizes = {p.name: p.stat().st_size for p in dest.glob("*.whl")}
    total = sum(sizes.values()) / 2 ** 20
    for name, size in sorted(sizes.items(), key=lambda kv: -kv[1]):
        print(f"{size / 2 ** 20:8.2f} MiB  {name}")
    print(f"{total:8.2f} MiB in {len(sizes)} wheels (budget {BUDGET_MIB} MiB)")
    if total > BUDGET_MIB:
        print("over the budget: the working tree and the wheels must travel together in 64 MiB", file=sys.stderr)
        return 1
    return 0


def unprepared(dest: Path) -> list[str]:
    """The ``name==version`` lines of ``wheels.txt`` with no wheel in ``dest`` (a wheel's file
    name starts ``{name}-{version}-`` with the name's runs of ``-_.`` as one ``_``)."""
    have = {tuple(normalise(x) for x in p.name.split("-")[:2]) for p in dest.glob("*.whl")}
    return [f"{n}=={v}" for n, v in carried() if (normalise(n), normalise(v)) not in have]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="download the wheels into DEST (default: .whl/ at the repository root)")
    prep.add_argument("--dest", type=Path, default=REPO / ".whl")
    sub.add_parser("list", help="print the carried wheels")
    ver = sub.add_parser("verify", help="exit 1, naming them, when wheels of wheels.txt are missing from DEST")
    ver.add_argument("--dest", type=Path, default=REPO / ".whl")
    args = p.parse_args(argv)
    if args.cmd == "verify":
        missing = unprepared(args.dest)
        if missing:
            print(f"{args.dest} lacks {', '.join(missing)}: run `bash scripts/gpu_check.sh --prepare-wheels` "
                  "where a package index is reachable", file=sys.stderr)
        return 1 if missing else 0
    if args.cmd == "list":
        for name, ver in carried():
            print(f"{name}=={ver}")
        return 0
    return prepare(args.dest)


if __name__ == "__main__":
    sys.exit(main())
