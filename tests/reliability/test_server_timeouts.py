"""Issue 26: no read timeout; 450 slow connections stayed open for 60 s.

Real sockets against a real uvicorn server, with both of uvicorn's HTTP implementations. Each
timeout under test is made tiny and the test waits for the close itself (``recv`` returning
``b""``); the only clock on the test's side is a liveness guard far above any timeout here, and a
connection the server never closes fails the test by reaching it. A close by a timeout sends
nothing, which tells it apart from a parser refusing the request (a 400).
"""

from __future__ import annotations

import json
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from closedloop.messages import AssistantMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.server import create_app
from closedloop.server.connections import ConnectionLimits
from closedloop.server.local import serve_app

LIVENESS_S = 60.0
TINY = 0.05
LONG = 600.0  # a clock that must not be the one that closes the connection in a test

pytestmark = pytest.mark.parametrize("http", [H11Protocol, HttpToolsProtocol], ids=["h11", "httptools"])


def _serve(http, **limits):
    app = create_app(ScriptedClient([AssistantMessage(content="pong")], cycle=True), "m")
    defaults = {"header_timeout_s": LONG, "body_timeout_s": LONG, "idle_timeout_s": LONG}
    return serve_app(app, limits=ConnectionLimits(**{**defaults, **limits}), http=http)


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=LIVENESS_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails at the liveness guard)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        pytest.fail(f"the server kept the connection open for {LIVENESS_S:.0f} s (got {data[:200]!r})")
    except ConnectionResetError:
        pass
    return data


def _request(sock: socket.socket, path: str = "/health") -> bytes:
    """One keep-alive GET on ``sock``; returns the response (headers and body, by Content-Length)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before answering: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_connection_that_sends_nothing_is_closed(http):
    with _serve(http, header_timeout_s=TINY) as url, _connect(url) as sock:
        assert _read_until_closed(sock) == b""


def test_half_sent_headers_are_closed_without_an_answer(http):
    with _serve(http, header_timeout_s=TINY) as url, _connect(url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: appl")
        assert _read_until_closed(sock) == b""


def test_a_slowloris_trickle_does_not_keep_the_connection(http):
    """A byte now and then resets no clock: the headers must be complete within the timeout."""
    with _serve(http, header_timeout_s=TINY) as url, _connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        deadline = time.monotonic() + LIVENESS_S
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable:
                assert _read_until_closed(sock) == b""
                return
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                return  # closed between the select and the send
        pytest.fail(f"a trickling client kept its connection for {LIVENESS_S:.0f} s")


def test_many_slow_connections_are_all_closed_and_the_server_still_answers(http):
    with _serve(http, header_timeout_s=TINY) as url:
        socks = [_connect(url) for _ in range(200)]
        try:
            for s in socks:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n")
            for s in socks:
                assert _read_until_closed(s) == b""
        finally:
            for s in socks:
                s.close()
        r = httpx.post(f"{url}/chat/completions", timeout=LIVENESS_S,
                       json={"model": "m", "messages": [{"role": "user", "content": "ping"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "pong"


def test_a_body_that_stops_halfway_is_closed(http):
    """Headers complete (their clock is LONG and stops there), body clock TINY."""
    with _serve(http, body_timeout_s=TINY) as url, _connect(url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": \"m\", ")
        assert _read_until_closed(sock) == b""


def test_a_slow_but_complete_body_is_answered(http):
    with _serve(http) as url, _connect(url) as sock:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "ping"}]}).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        for i in range(0, len(body), 7):
            sock.sendall(body[i:i + 7])
        answer = _read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 200") and b'"pong"' in answer


def test_an_idle_kept_alive_connection_is_closed(http):
    with _serve(http, idle_timeout_s=TINY) as url, _connect(url) as sock:
        assert _request(sock).startswith(b"HTTP/1.1 200")
        assert _read_until_closed(sock) == b""


def test_connections_beyond_the_cap_are_refused_with_a_503_and_closed(http):
    with _serve(http, max_connections=3) as url:
        held = [_connect(url) for _ in range(3)]
        try:
            for s in held:  # answered: each is registered on the server
                assert _request(s).startswith(b"HTTP/1.1 200")
            with _connect(url) as extra:
                refused = _read_until_closed(extra)
            assert refused.startswith(b"HTTP/1.1 503")
            error = json.loads(refused.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "too_many_connections" and "--max-connections" in error["message"]
            assert _request(held[0]).startswith(b"HTTP/1.1 200")  # the held ones are served on
        finally:
            held[2].close()
        deadline = time.monotonic() + LIVENESS_S
        while True:  # the server sees the close on its own time: then a new connection is served
            with _connect(url) as again:
                try:
                    if _request(again).startswith(b"HTTP/1.1 200"):
                        break
                except (AssertionError, ConnectionResetError):
                    pass
            assert time.monotonic() < deadline, "a freed slot was never reused"
        for s in held[:2]:
            s.close()
