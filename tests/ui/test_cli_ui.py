"""``closedloop ui`` as a user starts it: a real process, bound to loopback only, and a refusal
to serve other hosts unless told."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ui_support import free_port

from closedloop.cli import main
from closedloop.cli.ui import is_loopback


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("[::1]", True),
                                           ("localhost", True), ("0.0.0.0", False), ("::", False),
                                           ("192.168.1.5", False), ("example.com", False)])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5"])
def test_other_hosts_are_refused_unless_allowed(host, tmp_path, capsys):
    assert main(["ui", "--store", str(tmp_path / "runs.duckdb"), "--host", host]) == 2  # before the store is looked at
    err = capsys.readouterr().err
    assert "not a loopback address" in err and "--allow-remote" in err
    assert not (tmp_path / "runs.duckdb").exists()  # refused before anything was opened


def test_a_missing_store_is_an_error_not_a_new_file(tmp_path, capsys):
    assert main(["ui", "--store", str(tmp_path / "typo.duckdb")]) == 2
    assert "no run store at" in capsys.readouterr().err and not (tmp_path / "typo.duckdb").exists()


def _listening(port: int) -> list[str]:
    """Local addresses of TCP sockets listening on ``port`` (Linux /proc/net/tcp{,6})."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":  # TCP_LISTEN
                out.append(addr)
    return out


def test_the_command_serves_on_loopback_only(sample):
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc/net/tcp to read the bound address")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "closedloop", "ui", "--store", str(sample.path), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        banner = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in banner, banner + proc.stderr.read() if proc.poll() is not None else banner
        deadline = time.monotonic() + 120
        while True:  # the banner precedes the bind; wait for the socket, not a fixed time
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/", timeout=30)
                break
            except httpx.ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.05)
        assert r.status_code == 200 and "Runs" in r.text
        assert _listening(port) == ["0100007F"]  # 127.0.0.1, and nothing else
    finally:
        proc.terminate()
        proc.wait(timeout=60)
