"""What long jobs print (issue 30, "Logs"): in a log, one unwrapped line per item from the first
one; on a terminal, one live display; never a third-party progress bar. The τ evaluation of the
shipped helpdesk domain (gold replay, no model) and the KernelBench evaluation of the shipped sample
problems (no agent) are the real jobs, run as a user runs them: output to a file, then on a
pseudo-terminal."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
import types

from closedloop import terminal
from closedloop.samples import sample_path
from closedloop.terminal import JobProgress, format_metrics, make_console


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_unwrapped_line_per_item_from_the_first():
    log = io.StringIO()
    long_metrics = {f"metric_{i}": i / 7 for i in range(12)}
    with JobProgress("job", 3, unit="steps", stream=log) as progress:
        progress.advance(**long_metrics)
        assert log.getvalue().count("\n") == 1  # written at once, not at the end
        progress.advance()
        progress.advance()
    lines = log.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert len(lines[0]) > 200 and "metric_11 1.5714" in lines[0]  # one line, however long
    assert "eta" in lines[1] and "eta" not in lines[-1]


def test_the_eta_is_measured_from_the_first_item(monkeypatch):
    """Set-up time (100 s before the first item) and items done before a resume are not in the rate;
    the first item's own line has no rate to show."""
    clock = [0.0]
    monkeypatch.setattr(terminal, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    for done, total, expected in ((0, 5, "eta 0:00:30"), (2, 6, "eta 0:00:20")):
        log = io.StringIO()
        clock[0] = 0.0
        with JobProgress("job", total, done=done, stream=log) as progress:
            clock[0] = 100.0
            progress.advance()
            clock[0] = 110.0
            progress.advance()
        first, second = log.getvalue().splitlines()
        assert "eta" not in first and expected in second, (first, second)


def test_a_log_line_every_n_items_and_for_the_last():
    log = io.StringIO()
    with JobProgress("build", 120, every=50, stream=log) as progress:
        for _ in range(120):
            progress.advance(loss=0.5)
    assert [line.split()[1] for line in log.getvalue().splitlines()] == ["50/120", "100/120", "120/120"]


def test_a_terminal_gets_a_live_display_not_lines():
    tty = Tty()
    with JobProgress("job", 3, stream=tty) as progress:
        for _ in range(3):
            progress.advance(loss=0.25)
        progress.note("a note above the bar")
    out = tty.getvalue()
    assert "\x1b[" in out and "3/3" in out and "a note above the bar" in out
    assert "job  1/3" not in out  # not the log form


def test_consoles_off_a_terminal_never_hard_wrap(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    text = " · ".join(f"key{i} {i}" for i in range(40))
    make_console().print(text)
    assert capsys.readouterr().out == text + "\n"
    assert format_metrics({"lr": 2e-5, "loss": 0.25, "step": 3.0, "name": "x"}) == \
        "lr 2.00e-05 · loss 0.2500 · step 3 · name x"


def _tau(*extra: str, cwd, **kwargs):
    argv = [sys.executable, "-m", "closedloop", "eval", "tau", "--domain", "helpdesk", "--agent", "oracle",
            "--store", str(cwd / "runs.duckdb"), *extra]
    env = {**os.environ, "COLUMNS": ""}
    env.pop("COLUMNS")
    return subprocess.run(argv, cwd=cwd, env=env, timeout=300, **kwargs)


def test_tau_in_a_log_file_has_a_line_per_episode_and_whole_summary_rows(tmp_path):
    with open(tmp_path / "log", "w") as log:
        done = _tau("--split", "train", cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    assert done.returncode == 0
    text = (tmp_path / "log").read_text()
    assert "\r" not in text and "\x1b[" not in text
    progress = [line for line in text.splitlines() if line.startswith("τ helpdesk/train oracle")]
    assert [line.split()[3] for line in progress] == [f"{i}/8" for i in range(1, 9)]
    assert any(re.search(r"DB match\s+│ 8 of 8 episodes whose DB was checked", line) for line in text.splitlines())


def _on_a_terminal(run, **kwargs) -> tuple[subprocess.CompletedProcess, str]:
    """``run(stdout=..., stderr=...)`` with stderr on an 80-column pseudo-terminal: the process and
    what the terminal showed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # an 80-column terminal
    try:
        proc = run(stdout=subprocess.PIPE, stderr=slave, text=False, **kwargs)
    finally:
        os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child side is closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc, b"".join(chunks).decode(errors="replace")


def test_tau_on_a_terminal_draws_one_live_display(tmp_path):
    proc, shown = _on_a_terminal(lambda **kw: _tau("--split", "test", cwd=tmp_path, **kw))
    assert proc.returncode == 0
    assert "\x1b[" in shown and "4/4" in shown
    assert "τ helpdesk/test oracle  1/4" not in shown  # the per-episode log lines are for files only
    assert b"pass^1" in proc.stdout


def _kernelbench(*extra: str, cwd) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return [sys.executable, "-m", "closedloop", "eval", "kernelbench", "--problems", str(sample_path("kernelbench")),
            "--level", "1", "--store", str(cwd / "runs.duckdb"), "--cache-dir", str(cwd / "cache"), *extra], env


# Candidates for the sample problems, judged one at a time in order: problem 1 correct (plain torch: no
# C++ build to wait for), problem 2 without a file, problem 3 correct once the test opens its gate (so
# the job cannot end before the test has read the log). --policy off lets problem 3 see the file system.
_RELU = """import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x)
"""
_GATED = _RELU.replace("class ModelNew(nn.Module):\n", """import os
import time


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        while not os.path.exists({gate!r}):
            time.sleep(0.05)
""")


def _read_until(path, seen, proc) -> str:
    """The log once ``seen(text)`` holds, polled while the job runs (the job waits for the test)."""
    while True:
        text = path.read_text()
        if seen(text) or proc.poll() is not None:
            return text
        time.sleep(0.1)


def test_kernelbench_in_a_log_file_has_a_line_per_sample_as_each_finishes(tmp_path):
    candidates, gate, log_path = tmp_path / "candidates", tmp_path / "gate", tmp_path / "log"
    candidates.mkdir()
    (candidates / "1_ReLU.py").write_text(_RELU)
    (candidates / "3_ReLU_Positive.py").write_text(_GATED.replace("{gate!r}", repr(str(gate))))
    argv, env = _kernelbench("--candidates", str(candidates), "--policy", "off", "--concurrency", "1",
                             "--iters", "3", cwd=tmp_path)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            early = _read_until(log_path, lambda text: "kernelbench cpu candidates  " in text, proc)
            # a sample's line is in the log while the job still waits on another sample
            assert proc.poll() is None, early
            assert "3_ReLU_Positive" not in early and "KernelBench" not in early
            gate.touch()
            assert proc.wait(timeout=300) == 0
        finally:
            gate.touch()
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert "\r" not in text and "\x1b[" not in text
    lines = [line for line in text.splitlines() if line.startswith("kernelbench cpu candidates  ")]
    assert [line.split()[3] for line in lines] == ["1/3", "2/3", "3/3"]
    by_problem = {re.search(r"sample level1/(\w+)\.py#0", line).group(1): line for line in lines}
    assert re.search(r"status correct · speedup \d+\.\d\dx", by_problem["1_ReLU"])
    assert "status candidate file error · speedup -" in by_problem["2_Scale_Add"]
    assert re.search(r"status correct · speedup \d+\.\d\dx", by_problem["3_ReLU_Positive"])
    assert "correct 2" in lines[-1]
    assert text.index(lines[-1]) < text.index("KernelBench kernelbench-cpu-candidates")  # the summary after


def test_kernelbench_on_a_terminal_draws_one_live_display(tmp_path):
    argv, env = _kernelbench("--candidate-source", "reference", "--iters", "3", cwd=tmp_path)
    proc, shown = _on_a_terminal(lambda **kw: subprocess.run(argv, cwd=tmp_path, env=env, timeout=300, **kw))
    assert proc.returncode == 0, shown
    assert "\x1b[" in shown and "3/3" in shown and "eta" in shown
    assert "kernelbench cpu reference  1/3" not in shown  # the per-sample log lines are for files only
    assert b"statuses" in proc.stdout and b"correct: 3" in proc.stdout


def test_kernelbench_resumed_says_what_the_store_already_holds(tmp_path):
    argv, env = _kernelbench("--candidate-source", "reference", "--iters", "3", "--name", "again", cwd=tmp_path)
    first = subprocess.run(argv, cwd=tmp_path, env=env, timeout=300, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("kernelbench cpu reference  ") == 3
    again = subprocess.run(argv, cwd=tmp_path, env=env, timeout=300, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert again.stderr.strip() == "kernelbench cpu reference: 3 of 3 samples already in the store (3 correct)"
    assert "KernelBench again (resumed)" in again.stdout
