"""``closedloop serve`` argument checking: bad input exits 2 with a message, before loading anything."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from closedloop.cli import serve as serve_cli
from closedloop.server.connections import ConnectionLimits
from closedloop.server.local import serve_subprocess

REPO = Path(__file__).resolve().parents[2]


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "closedloop", "serve", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["--model", "nonsense"], "model spec"),
    (["--model", "openai:m@ftp://x"], "must start with http"),
    (["--model", "openai:m@http://127.0.0.1:9/v1", "--max-batch-size", "4"], "apply to hf"),
    (["--model", "hf:/nowhere", "--port", "70000"], "out of range"),
    # checked before the model is loaded: hf:/nowhere would fail otherwise
    (["--model", "hf:/nowhere", "--max-request-bytes", "0"], "--max-request-bytes"),
    (["--model", "hf:/nowhere", "--header-timeout", "0"], "--header-timeout"),
    (["--model", "hf:/nowhere", "--body-timeout", "-1"], "--body-timeout"),
    (["--model", "hf:/nowhere", "--idle-timeout", "0"], "--idle-timeout"),
    (["--model", "hf:/nowhere", "--header-timeout", "inf"], "--header-timeout"),
    (["--model", "hf:/nowhere", "--max-connections", "0"], "--max-connections"),
])
def test_bad_arguments_exit_2(args, message):
    r = serve(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_the_help_shows_the_real_defaults():
    assert serve_cli._LIMITS == ConnectionLimits().model_dump()


def test_the_connection_limits_reach_the_server():
    """A silent connection is closed by --header-timeout; one over --max-connections is refused
    (an openai: spec starts without loading anything; nothing here reaches its upstream)."""
    upstream = "openai:m@http://127.0.0.1:9/v1"
    with serve_subprocess(upstream, "--header-timeout", "0.05", served_name="m") as url:
        with _connect(url) as silent:
            assert silent.recv(65536) == b""  # closed by the header timeout, with no answer
    with serve_subprocess(upstream, "--max-connections", "1", "--idle-timeout", "600", served_name="m") as url:
        deadline = time.monotonic() + 60
        while True:  # until the start-up probe's connection is no longer counted
            first = _connect(url)
            try:
                first.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
                if first.recv(65536).startswith(b"HTTP/1.1 200"):
                    break  # first is counted, and kept alive
            except ConnectionError:
                pass
            first.close()
            assert time.monotonic() < deadline, "the one connection allowed never became free"
        with first, _connect(url) as second:
            assert second.recv(65536).startswith(b"HTTP/1.1 503")


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=60)
