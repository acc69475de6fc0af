"""Run a server on loopback from Python: an ASGI app in a background thread, or ``closedloop
serve`` as a subprocess, as a notebook, a script or a test needs it. Both yield the OpenAI base URL
(``http://127.0.0.1:PORT/v1``) once the server answers, and stop it on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterator, Mapping

from closedloop.server.connections import ConnectionLimits, uvicorn_config


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(app: Any, *, port: int | None = None, timeout_s: float = 20.0, limits: ConnectionLimits | None = None,
              http: type[asyncio.Protocol] | None = None) -> Iterator[str]:
    """Serve an ASGI app (e.g. :func:`closedloop.server.create_app`) with uvicorn in a daemon thread,
    under the connection ``limits`` ``closedloop serve`` uses (its defaults unless given); ``http``
    picks uvicorn's protocol (h11 or httptools; uvicorn's choice by default)."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, limits, http, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_subprocess(model: str, *extra: str, served_name: str = "tiny", port: int | None = None,
                     env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                     timeout_s: float = 120.0) -> Iterator[str]:
    """``closedloop serve --model MODEL --served-name NAME --port PORT *extra`` as a user starts it;
    waits until ``/v1/models`` answers (the process's output is raised if it exits first)."""
    import httpx

    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "closedloop", "serve", "--model", model, "--served-name",
                             served_name, "--port", str(port), *extra],
                            cwd=cwd, env=dict(env) if env is not None else None,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                assert proc.stdout is not None  # stdout=PIPE
                raise RuntimeError(f"closedloop serve exited: {proc.stdout.read().decode(errors='replace')}")
            try:
                if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"closedloop serve did not answer within {timeout_s:.0f} s")
            time.sleep(0.3)
        yield url
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Terminate a server process, killing it if it does not exit within ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


__all__ = ["free_port", "serve_app", "serve_subprocess", "stop_process"]
