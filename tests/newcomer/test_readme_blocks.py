"""Every shell and Python block of the READMEs a user is pointed to runs as written (issue 30).

Each README's blocks run in order, as a newcomer pastes them, in one fresh working directory with a
fresh ``HOME`` (so a fresh run store), offline, with the repository's environment on ``PATH``:
later blocks use what earlier ones created (``out/tiny``, ``sft.yaml``). What scales them down
for CI is an environment variable the README documents, never an edit of the command:
``CLOSEDLOOP_TINY_CACHE`` lets every ``closedloop model tiny`` with the same settings copy one
build (made once per test session, shared with ``test_tiny_preset.py``). Blocks marked ``skip``
(network services, GPUs, the suite itself) are reported with their reason; ``heavy`` ones run with
``CLOSEDLOOP_DOCS_HEAVY=1`` (see :mod:`docblocks`).
"""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from docblocks import Block, blocks

REPO = Path(__file__).resolve().parents[2]
# The READMEs a newcomer is pointed to for running things (evals/kernelbench/README.md is a threat
# model with no commands).
READMES = ["README.md", "evals/tau/README.md", "trainers/README.md"]
BLOCK_TIMEOUT_S = 900
READY_TIMEOUT_S = 600
# Variables of this machine or session that a newcomer's shell would not have.
_NOT_INHERITED = ("CLOSEDLOOP_STORE", "CLOSEDLOOP_TINY_MODEL", "TAU2_DATA_DIR", "CLOSEDLOOP_ARTIFACTS", "COLUMNS",
                  "OPENAI_API_KEY", "OPENAI_BASE_URL", "VIRTUAL_ENV")


def _env(workdir: Path, tiny_cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED and not k.startswith("PYTEST")}
    home = workdir / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               CLOSEDLOOP_TINY_CACHE=str(tiny_cache), PYTHONUNBUFFERED="1")
    return env


def _ready(target: str) -> bool:
    """Whether ``target`` (a port on loopback, or a URL) answers."""
    if target.isdigit():
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", int(target))) == 0
    try:
        with urllib.request.urlopen(target, timeout=5) as r:
            return r.status < 500
    except urllib.error.HTTPError as e:
        return e.code < 500
    except (urllib.error.URLError, OSError):
        return False


def _children_cpu_s() -> float:
    """CPU seconds of this test's finished child processes (what a block costs, whatever the load)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Session:
    """One README's run: its working directory, environment and the servers its blocks started."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir, self.env = workdir, env
        self.servers: list[tuple[Block, subprocess.Popen, Path]] = []

    def _argv(self, block: Block, n: int) -> list[str]:
        script = self.workdir / ".blocks" / f"{n:02d}.{'py' if block.kind == 'python' else 'sh'}"
        script.parent.mkdir(exist_ok=True)
        script.write_text(block.code)
        return [sys.executable, str(script)] if block.kind == "python" else ["bash", "-eo", "pipefail", str(script)]

    def _cwd(self, block: Block) -> Path:
        return REPO if block.directives.get("cwd") == "repo" else self.workdir

    def run(self, block: Block, n: int) -> None:
        argv = self._argv(block, n)
        if "background" in block.directives:
            self._start(block, argv, n)
            return
        stdin = block.stdin
        done = subprocess.run(argv, cwd=self._cwd(block), env=self.env, input=stdin if stdin is not None else "",
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        expected = block.directives.get("expect")
        if done.returncode != 0 or (expected is not None and expected not in done.stdout):
            why = f"exited {done.returncode}" if done.returncode else f"printed no {expected!r}"
            pytest.fail(f"{block.where} {why}:\n{block.code}\n--- stdout\n{done.stdout[-4000:]}"
                        f"\n--- stderr\n{done.stderr[-4000:]}", pytrace=False)

    def _start(self, block: Block, argv: list[str], n: int) -> None:
        target = block.directives["background"]
        port = int(target) if target.isdigit() else urllib.parse.urlsplit(target).port
        if port is not None and _ready(str(port)):  # a fixed port of the README is taken here by another process
            pytest.skip(f"{block.where}: port {port} already accepts connections before the block starts its server "
                        "(another process holds the README's port), so this block and the ones after it cannot "
                        "run as written on this machine")
        log = self.workdir / ".blocks" / f"{n:02d}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, cwd=self._cwd(block), env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.servers.append((block, proc, log))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(target):  # waits for the server's own signal (it answers), not for a fixed time
            if proc.poll() is not None:
                pytest.fail(f"{block.where}: the server exited ({proc.returncode}) before answering {target}:\n"
                            f"{log.read_text()[-4000:]}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"{block.where}: {target} did not answer in {READY_TIMEOUT_S} s:\n"
                            f"{log.read_text()[-4000:]}", pytrace=False)
            time.sleep(0.2)

    def stop(self) -> None:
        for block, proc, _ in reversed(self.servers):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("readme", READMES)
def test_readme_blocks_run_as_written(readme, tmp_path, tiny_build_cache):
    found = blocks(REPO / readme)
    assert found, f"{readme} has no shell or Python block"
    heavy = os.environ.get("CLOSEDLOOP_DOCS_HEAVY") == "1"
    session = Session(tmp_path, _env(tmp_path, tiny_build_cache))
    skipped: list[str] = []
    began, cpu_before = time.monotonic(), _children_cpu_s()
    try:
        for n, block in enumerate(found):
            if "skip" in block.directives or ("heavy" in block.directives and not heavy):
                why = block.directives.get("skip") or f"heavy: {block.directives['heavy']}"
                skipped.append(f"{block.where} ({why})")
                continue
            started, cpu = time.monotonic(), _children_cpu_s()
            session.run(block, n)
            print(f"ran {block.where}: {time.monotonic() - started:.1f} s wall, {_children_cpu_s() - cpu:.1f} s CPU")
    finally:
        session.stop()
        print(f"{readme}: {time.monotonic() - began:.0f} s wall, {_children_cpu_s() - cpu_before:.0f} s CPU "
              f"(servers included), load {os.getloadavg()[0]:.1f}")
    for line in skipped:
        print(f"not run: {line}")


def test_every_readme_directive_is_understood_and_skips_say_why():
    for readme in READMES:
        for block in blocks(REPO / readme):
            for kind in ("skip", "heavy", "background", "expect"):
                if kind in block.directives:
                    assert block.directives[kind], f"{block.where}: {kind} needs a reason or target"
            # a reason that names the test covering the same path names one that exists
            for named in re.findall(r"tests/[\w/]+(?:\.py)?", block.directives.get("heavy", "") +
                                    " " + block.directives.get("skip", "")):
                assert (REPO / named).exists(), f"{block.where}: its reason names {named}, which does not exist"


def test_directives_stand_right_above_their_block(tmp_path):
    doc = tmp_path / "README.md"
    doc.write_text("<!-- docs-test: skip a server -->\n```bash\necho hi\n```\n\n```json\n{}\n```\n")
    (only,) = blocks(doc)
    assert only.directives == {"skip": "a server"} and only.code == "echo hi\n" and only.line == 2
    doc.write_text("<!-- docs-test: skip a server -->\nsome text\n```bash\necho hi\n```\n")
    with pytest.raises(ValueError, match="right above its block"):
        blocks(doc)
    doc.write_text("<!-- docs-test: skipp a server -->\n```bash\necho hi\n```\n")
    with pytest.raises(ValueError, match="unknown docs-test directive 'skipp'"):
        blocks(doc)
