"""The channel between the judge (trusted parent) and a sandboxed KernelBench process.

Messages are length-prefixed JSON objects: bounded in size (``MAX_FRAME``) and depth
(``MAX_DEPTH``), parsed without recursion risk (:func:`closedloop.sandbox.bounded_json_loads`),
never executable (no pickle). Tensors do not travel in messages: they live in an *arena*, a
memfd the parent creates and maps, shared with one sandboxed process; a message only says where a
tensor lies (dtype, shape, offset), and the parent checks every such claim against the arena's
bounds before it reads a byte.

Why a separate data plane: the parent reads a candidate's outputs straight from memory it owns
(no copy through the socket, nothing the candidate can make the parent parse but a few numbers).

This module is imported on both sides (stdlib and ``closedloop.sandbox`` only, so the sandboxed
side stays light); the parent also uses :class:`Arena` and :func:`parse_value`.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from closedloop.sandbox import bounded_json_loads

MAX_FRAME = 8 << 20  # bytes of JSON in one message (problem and candidate sources travel this way)
MAX_DEPTH = 16  # nesting of a message's JSON
MAX_VALUE_DEPTH = 4  # nesting of lists/tuples in a model's inputs or outputs
MAX_LEAVES = 64  # tensors and scalars in one value
MAX_NDIM = 8
ALIGN = 64

#: dtype name -> item size. Only these cross the channel.
DTYPES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
          "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}


class ProtocolError(Exception):
    """What the other side sent cannot be accepted (malformed, too large, too deep, out of bounds)."""


class ChannelClosed(ProtocolError):
    """The other side closed the channel (it exited, crashed, or was killed)."""


class ChannelTimeout(Exception):
    """The other side did not answer before the deadline."""


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg, allow_nan=True).encode()
    frame = struct.pack(">I", len(data)) + data
    sent = socket.send_fds(sock, [frame], fds) if fds else 0
    sock.sendall(frame[sent:])


def _recv_exact(sock: socket.socket, n: int, deadline: float | None, fds: list[int] | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChannelTimeout("no answer before the deadline")
            sock.settimeout(left)
        try:
            if fds is not None:
                chunk, got, _, _ = socket.recv_fds(sock, n - len(buf), 4)
                fds.extend(got)
            else:
                chunk = sock.recv(min(n - len(buf), 1 << 20))
        except socket.timeout:
            raise ChannelTimeout("no answer before the deadline") from None
        except OSError as exc:
            raise ChannelClosed(f"the channel failed: {exc}") from None
        if not chunk:
            raise ChannelClosed("the other side closed the channel")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket, *, deadline: float | None = None, max_bytes: int = MAX_FRAME,
         fds: list[int] | None = None) -> dict[str, Any]:
    """One message. ``fds``: collect descriptors sent along (only the sandboxed side accepts any;
    descriptors sent to a plain ``recv`` are discarded by the kernel)."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, deadline, fds))
    if n > max_bytes:
        raise ProtocolError(f"a message of {n} bytes (limit {max_bytes})")
    data = _recv_exact(sock, n, deadline, fds)
    try:
        msg = bounded_json_loads(data, max_depth=MAX_DEPTH)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"an unreadable message: {str(exc)[:200]}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("a message without an op")
    return msg


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """A memfd mapped here, shared with one sandboxed process (which maps the same file)."""

    def __init__(self, size: int):
        self.fd = os.memfd_create("kernelbench-arena", os.MFD_CLOEXEC)
        self.size = 0
        self.mm: mmap.mmap | None = None
        self.resize(size)

    def resize(self, size: int) -> None:
        size = max(align(size), 1 << 16)
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
                pass
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.size = size

    def view(self, offset: int, nbytes: int) -> memoryview:
        assert self.mm is not None
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ProtocolError(f"bytes [{offset}, {offset + nbytes}) lie outside the arena of {self.size}")
        return memoryview(self.mm)[offset:offset + nbytes]

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                pass
            self.mm = None
        os.close(self.fd)


# ------------------------------------------------------------------ values (inputs and outputs)
# A value is {"t": "tensor", "dtype", "shape", "offset"} | {"t": "scalar", "v"} | {"t": "list"|"tuple",
# "items": [...]} | {"t": "other", "type"} (something that cannot cross: the judge says so).


@dataclass(frozen=True)
class TensorRef:
    dtype: str
    shape: tuple[int, ...]
    offset: int | None  # None in a "done" description: not written to the arena yet
    alias_of: int | None = None  # the candidate's own claim that this output is input i (a hint only)

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Other:
    type_name: str


def parse_value(obj: Any, *, arena_size: int | None = None, need_offsets: bool = True) -> Any:
    """Check a value description against the limits (and the arena's bounds) and return it as
    nested lists/tuples of :class:`TensorRef`, scalars and :class:`Other`. Raises ProtocolError."""
    leaves = 0

    def walk(node: Any, depth: int) -> Any:
        nonlocal leaves
        if not isinstance(node, dict):
            raise ProtocolError("a value that is not an object")
        kind = node.get("t")
        if kind in ("list", "tuple"):
            items = node.get("items")
            if depth >= MAX_VALUE_DEPTH:
                raise ProtocolError(f"a value nested deeper than {MAX_VALUE_DEPTH} levels")
            if not isinstance(items, list):
                raise ProtocolError("a sequence without items")
            seq = [walk(x, depth + 1) for x in items]
            return seq if kind == "list" else tuple(seq)
        leaves += 1
        if leaves > MAX_LEAVES:
            raise ProtocolError(f"a value with more than {MAX_LEAVES} leaves")
        if kind == "scalar":
            v = node.get("v")
            if v is not None and not isinstance(v, (bool, int, float)):
                raise ProtocolError("a scalar that is not a number, a bool or None")
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 2 ** 63:
                raise ProtocolError("an integer out of range")
            return v
        if kind == "other":
            return Other(str(node.get("type"))[:100])
        if kind != "tensor":
            raise ProtocolError(f"an unknown value kind {str(kind)[:40]!r}")
        dtype, shape, offset = node.get("dtype"), node.get("shape"), node.get("offset")
        if dtype not in DTYPES:
            return Other(f"tensor of dtype {str(dtype)[:40]}")
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2 ** 40 for d in shape)):
            raise ProtocolError("a tensor shape that is not a short list of sizes")
        alias = node.get("alias_of")
        ref = TensorRef(dtype, tuple(shape), None, alias if isinstance(alias, int) and not isinstance(alias, bool)
                        else None)
        if ref.nbytes > 1 << 40:
            raise ProtocolError("a tensor over 1 TiB")
        if need_offsets:
            if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or offset % ALIGN:
                raise ProtocolError("a tensor without a valid offset")
            if arena_size is not None and offset + ref.nbytes > arena_size:
                raise ProtocolError("a tensor that lies outside the arena")
            ref = TensorRef(dtype, ref.shape, offset, ref.alias_of)
        return ref

    return walk(obj, 0)


def leaves_of(value: Any) -> list[Any]:
    """The leaves of a parsed value, in order."""
    out: list[Any] = []
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, (list, tuple)):
            stack.extend(reversed(node))
        else:
            out.append(node)
    return out
