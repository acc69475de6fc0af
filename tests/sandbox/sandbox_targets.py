"""Targets the sandbox tests run in a child process (importable through the test's python_path)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time


def add(a: int, b: int = 0) -> dict:
    return {"sum": a + b, "cwd": os.getcwd(), "home": os.environ.get("HOME"), "env": sorted(os.environ)}


async def async_mul(a: int, b: int) -> int:
    return a * b


def boom(msg: str) -> None:
    raise ValueError(msg)


def not_json() -> object:
    return object()


def loop_forever() -> None:
    while True:
        pass


def sleep_forever() -> None:
    time.sleep(3600)


def spin_then_write(path: str, seconds: float) -> None:
    """Keeps running after a timeout if nothing kills it: it would write to ``path``."""
    time.sleep(seconds)
    with open(path, "w") as fh:
        fh.write("still alive")


def segfault() -> None:
    import ctypes

    ctypes.string_at(0)


def abort() -> None:
    os.abort()


def allocate() -> int:
    chunks = []
    while True:
        chunks.append(bytearray(64 << 20))


def fork_bomb(n: int, pid_file: str) -> str:
    """Forks ``n`` sleepers; each records its host PID (``/proc/self`` names it in the host's
    PID namespace) so the test can check that none outlives the sandbox."""
    started = 0
    try:
        for _ in range(n):
            if os.fork() == 0:
                with open(pid_file, "a") as fh:
                    fh.write(os.readlink("/proc/self") + "\n")
                time.sleep(60)
                os._exit(0)
            started += 1
    except OSError as exc:
        return f"refused after {started}: {exc.__class__.__name__}"
    return f"started {started}"


def open_socket(host: str, port: int) -> str:
    s = socket.create_connection((host, port), timeout=2)
    s.close()
    return "connected"


def write_file(path: str) -> str:
    with open(path, "w") as fh:
        fh.write("x")
    return "written"


def shout(n: int) -> int:
    sys.stdout.write("y" * n)
    sys.stderr.write("e" * 10)
    return n


def leave_thread() -> str:
    threading.Thread(target=time.sleep, args=(3600,)).start()  # non-daemon: would block exit
    return "returned"


def escape_group(path: str) -> str:
    """A grandchild that leaves the process group and writes later unless its namespace dies."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        time.sleep(1.5)
        with open(path, "w") as fh:
            fh.write("escaped")
        os._exit(0)
    return "parent done"


def self_kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def big_file(path: str, mb: int) -> str:
    with open(path, "wb") as fh:
        for _ in range(mb):
            fh.write(b"\0" * (1 << 20))
    return "written"


def open_fds() -> list[int]:
    """The descriptors this process holds."""
    import os

    held = []
    for fd in range(1024):
        try:
            os.fstat(fd)
        except OSError:
            continue
        held.append(fd)
    return held


def _host_pid() -> int:
    return int(os.readlink("/proc/self"))  # the host's /proc names this process by its host PID


def report_then_spin(marker: str, out: str) -> None:
    """Says it started (host PID and working directory, written atomically to ``marker``), then
    keeps writing to ``out`` forever: only something outside can stop it."""
    import json

    tmp = marker + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"pid": _host_pid(), "cwd": os.getcwd()}, fh)
    os.replace(tmp, marker)
    n = 0
    while True:
        with open(out, "a") as fh:
            fh.write(f"{n}\n")
        n += 1
        time.sleep(0.01)


def forge_result(text: str) -> None:
    """Writes its own result file (``text``) and exits before the real one would be written."""
    with open(os.path.join(os.getcwd(), "..", "io", "result.json"), "w") as fh:
        fh.write(text)
    os._exit(0)


def channel_echo(channel_fd: int) -> int:
    """Reads lines on the session's channel and sends each back upper-cased, then its host PID
    when asked; returns how many lines it echoed once the caller closes the channel."""
    chan = socket.socket(fileno=channel_fd)
    f = chan.makefile("rwb")
    n = 0
    for line in f:
        if line.strip() == b"pid":
            f.write(f"{_host_pid()}\n".encode())
        else:
            f.write(line.upper())
            n += 1
        f.flush()
    return n


def channel_then_sleep(channel_fd: int) -> None:
    chan = socket.socket(fileno=channel_fd)
    chan.sendall(f"{_host_pid()}\n".encode())
    time.sleep(3600)
