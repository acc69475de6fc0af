"""``closedloop serve`` argument checking: bad input exits 2 with a message, before loading anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "closedloop", "serve", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["--model", "nonsense"], "model spec"),
    (["--model", "openai:m@ftp://x"], "must start with http"),
    (["--model", "openai:m@http://127.0.0.1:9/v1", "--max-batch-size", "4"], "apply to hf"),
    (["--model", "hf:/nowhere", "--port", "70000"], "out of range"),
])
def test_bad_arguments_exit_2(args, message):
    r = serve(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
