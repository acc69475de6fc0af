"""Bounds on connections, so slow or idle clients cannot hold the server (``closedloop serve``).

uvicorn closes a kept-alive connection that stays idle after a response (``timeout_keep_alive``),
and nothing else: a connection that never sends a request, or sends its headers a byte every few
seconds (slow-loris), or stops halfway through its body, stays open for good; 450 such connections
were still open after 60 s. Its ``limit_concurrency`` answers 503 only once a request's headers are
complete, so connections beyond the limit are still accepted and held. An ASGI middleware cannot
help: the app is only called once the headers are in. So the HTTP protocol itself is extended
(uvicorn takes a protocol class), with Go's ``net/http`` server as the model:

* ``header_timeout_s`` (Go's ``ReadHeaderTimeout``): from the moment a connection opens, or the first
  byte of a further request on a kept-alive one, until the request line and headers are complete.
* ``body_timeout_s``: from the end of the headers until the end of the body (the server's body limit
  is 8 MiB by default: 60 s allows 140 KB/s).
* ``idle_timeout_s`` (Go's ``IdleTimeout``; uvicorn's ``timeout_keep_alive``): after a response, for
  the next request to start.
* ``max_connections``: a connection opened while that many are open is answered 503 (OpenAI's error
  shape) and closed at once, before it can hold anything.

Each timeout closes the connection (the handler of a request whose body stopped sees a disconnect).
A response being written is never cut: the clocks stop when the request has been read. Pipelined
requests (rare; HTTP/1.1 clients do not pipeline) are covered by the idle timeout only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("closedloop.server")


class ConnectionLimits(BaseModel):
    """How long a client may take and how many may be connected (see the module docstring)."""

    model_config = ConfigDict(frozen=True)

    header_timeout_s: float = Field(default=20.0, gt=0, allow_inf_nan=False)
    body_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    idle_timeout_s: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    max_connections: int = Field(default=1000, ge=1)


def _refusal(limit: int) -> bytes:
    body = json.dumps({"error": {"message": f"this server accepts at most {limit} connections at once "
                                            "(closedloop serve --max-connections); retry later",
                                 "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _Bounded:
    """Mixed into uvicorn's HTTP protocol (h11 or httptools): the read clocks and the connection cap.

    It reads the protocol's own state: ``cycle`` is replaced when a request's headers are parsed,
    ``cycle.more_body`` turns false when its body is complete, ``cycle.response_complete`` when the
    response is sent.
    """

    limits: ConnectionLimits  # set on the class made by http_protocol()
    # uvicorn's protocol attributes, used here
    connections: set[Any]
    cycle: Any
    transport: Any
    loop: asyncio.AbstractEventLoop

    _timer: asyncio.TimerHandle | None = None
    _phase: str | None = None  # "headers" or "body" while a clock runs
    _cycle_before: Any = None  # the cycle in place when the header clock started

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self.limits.max_connections:
            log.warning("refused a connection: %d are open (closedloop serve --max-connections)",
                        len(self.connections) - 1)
            transport.write(_refusal(self.limits.max_connections))
            transport.close()
            return
        self._start("headers")

    def data_received(self, data: bytes) -> None:
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            self._start("headers")  # the first byte of the next request on a kept-alive connection
        super().data_received(data)  # type: ignore[misc]
        self._advance()

    def on_response_complete(self) -> None:
        self._stop()  # an early answer (413, 403) before the body was read: the idle clock takes over
        super().on_response_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        super().connection_lost(exc)  # type: ignore[misc]

    def _advance(self) -> None:
        cycle = self.cycle
        if self._phase == "headers" and cycle is not None and cycle is not self._cycle_before:
            if cycle.more_body:
                self._start("body")
            else:
                self._stop()
        elif self._phase == "body" and not cycle.more_body:
            self._stop()

    def _start(self, phase: str) -> None:
        self._stop()
        if self.transport is None or self.transport.is_closing():
            return
        self._phase = phase
        self._cycle_before = self.cycle
        timeout = self.limits.header_timeout_s if phase == "headers" else self.limits.body_timeout_s
        self._timer = self.loop.call_later(timeout, self._expired, phase, timeout)

    def _stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _expired(self, phase: str, timeout: float) -> None:
        self._timer, self._phase = None, None
        if not self.transport.is_closing():
            log.info("closing a connection whose request %s did not arrive within %.3g s", phase, timeout)
            self.transport.close()


def http_protocol(limits: ConnectionLimits, base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``base``: the one uvicorn would pick, httptools when installed,
    else h11) with ``limits`` enforced; pass it as ``uvicorn.Config(http=...)``."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    return type(f"Bounded{base.__name__}", (_Bounded, base), {"limits": limits})


def uvicorn_config(app: Any, host: str, port: int, limits: ConnectionLimits | None = None,
                   base: type[asyncio.Protocol] | None = None, **kwargs: Any) -> Any:
    """The ``uvicorn.Config`` every closedloop server runs under: ``limits`` (default
    :class:`ConnectionLimits`) enforced by the protocol, uvicorn's keep-alive timeout set from them."""
    import uvicorn

    limits = limits or ConnectionLimits()
    # uvicorn types timeout_keep_alive as int but only hands it to loop.call_later: a float is kept.
    return uvicorn.Config(app, host=host, port=port, http=http_protocol(limits, base),
                          timeout_keep_alive=limits.idle_timeout_s, **kwargs)  # type: ignore[arg-type]


__all__ = ["ConnectionLimits", "http_protocol", "uvicorn_config"]
