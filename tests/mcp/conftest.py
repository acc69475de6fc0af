"""Shared by the MCP tests: waiting for a server process to listen."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest


def _wait_listening(proc: subprocess.Popen, port: int, log: Path) -> None:
    """Until the server accepts connections, or has exited. No deadline races its start (seconds
    on an idle machine, minutes at load 16); the one bound is a guard against a hung test run."""
    guard = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except OSError:
            if time.monotonic() > guard:
                raise RuntimeError(f"server not listening after 900 s:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.2)


@pytest.fixture(scope="session")
def wait_listening() -> Callable[[subprocess.Popen, int, Path], None]:
    return _wait_listening
