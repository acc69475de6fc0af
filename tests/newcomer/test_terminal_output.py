"""What long jobs print (issue 30, "Logs"): in a log, one unwrapped line per item from the first
one; on a terminal, one live display; never a third-party progress bar. The τ evaluation of the
shipped helpdesk domain (gold replay, no model) is the real job, run as a user runs it: output to a
file, then on a pseudo-terminal."""

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
import types

from closedloop import terminal
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


def test_tau_on_a_terminal_draws_one_live_display(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # an 80-column terminal
    try:
        proc = _tau("--split", "test", cwd=tmp_path, stdout=subprocess.PIPE, stderr=slave, text=False)
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
    assert proc.returncode == 0
    shown = b"".join(chunks).decode(errors="replace")
    assert "\x1b[" in shown and "4/4" in shown
    assert "τ helpdesk/test oracle  1/4" not in shown  # the per-episode log lines are for files only
    assert b"pass^1" in proc.stdout
