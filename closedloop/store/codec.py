"""How a turn's token ids, logprobs and loss mask are kept: compact BLOBs with a fixed layout.

Layout of the ``turns`` columns since schema version 3 (no header; SQL ``NULL`` is a field that
was ``None``, an empty BLOB is ``[]``; one exception: ``loss_mask`` is ``NULL`` too when it is the
default mask, 0 on every prompt id and 1 on every completion id, which is what ``Turn`` fills in
when it is not given and what reading restores, so the common mask costs no bytes):

======================  =====================================  ===========================
column                  element                                bytes per element
======================  =====================================  ===========================
``prompt_ids``          little-endian ``int32``                4
``completion_ids``      little-endian ``int32``                4
``logprobs``            little-endian IEEE-754 ``float64``     8
``loss_mask``           ``int8``                               1
======================  =====================================  ===========================

Why BLOBs and not DuckDB ``LIST`` columns (versions 1-2): a list column costs a Python object per
element on the way in (Arrow conversion of Python ints) and on the way out (DuckDB builds a Python
int per element), and its child vectors are analysed for compression element by element at every
checkpoint. A BLOB is one ``bytes`` object per turn: encoding is one C loop (``array``), the insert
is a memcpy, reading is ``memoryview.cast(...).tolist()``. The value ranges are the ones the list
columns had (``INTEGER``, ``DOUBLE``, ``TINYINT``), so nothing that was storable before is refused,
and ``float64`` keeps every Python float exactly (``float32`` would not round-trip). Plain SQL
sees bytes: read turns through :class:`~closedloop.store.RunStore`, or export Parquet
(``RunStore.export_parquet`` writes these columns back as lists).
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any, Literal, Sequence

__all__ = ["encode_ids", "encode_floats", "encode_mask", "decode_ids", "decode_floats", "decode_mask",
           "decode_turn_arrays", "BLOB_KINDS", "turn_arrays_to_lists", "list_column_to_blob"]

_LITTLE = sys.byteorder == "little"
_INT32: Literal["i", "l"] = "i" if array("i").itemsize == 4 else "l"
assert array(_INT32).itemsize == 4 and array("d").itemsize == 8 and array("b").itemsize == 1
_Code = Literal["i", "l", "d", "b"]  # the ``array`` typecodes of the stored columns

# column -> ``array`` typecode of its elements
BLOB_KINDS: dict[str, str] = {"prompt_ids": _INT32, "completion_ids": _INT32, "logprobs": "d", "loss_mask": "b"}


# ``struct.Struct`` per (typecode, length): packing a list through a compiled Struct is 2.5x faster
# than ``array(code, list)`` (which parses every element with a format string).
_STRUCTS: dict[tuple[str, int], struct.Struct] = {}
_STANDARD = {_INT32: "i", "d": "d", "b": "b"}  # "<" + these: little-endian, standard sizes


def _pack(code: str, values: Sequence[Any], what: str) -> bytes:
    key = (code, len(values))
    packer = _STRUCTS.get(key)
    if packer is None:
        if len(_STRUCTS) > 4096:
            _STRUCTS.clear()
        packer = _STRUCTS[key] = struct.Struct(f"<{key[1]}{_STANDARD[code]}")
    try:
        return packer.pack(*values)
    except (struct.error, OverflowError, TypeError) as e:
        limits = {"b": "-128..127 (int8)", "d": "float64"}.get(code, "-2**31..2**31-1 (int32)")
        raise ValueError(f"{what} values must be numbers in {limits}: {e}") from None


def encode_ids(values: Sequence[int] | None, what: str = "token ids") -> bytes | None:
    """Token ids as little-endian int32 bytes (``None`` stays ``None``)."""
    return None if values is None else _pack(_INT32, values, what)


def encode_floats(values: Sequence[float] | None, what: str = "logprobs") -> bytes | None:
    """Floats as little-endian float64 bytes: lossless for Python floats."""
    return None if values is None else _pack("d", values, what)


def encode_mask(values: Sequence[int] | None, what: str = "loss_mask") -> bytes | None:
    """A mask as int8 bytes. 0/1 masks (every real one) take the ``bytes(list)`` fast path."""
    if values is None:
        return None
    try:
        raw = bytes(values)  # one C loop; ValueError outside 0..255, TypeError for non-ints
    except (ValueError, TypeError):
        return _pack("b", values, what)
    return raw if raw.isascii() else _pack("b", values, what)  # 128..255 is not int8


def _unpack(code: _Code, blob: bytes) -> list[Any]:
    if _LITTLE:
        return memoryview(blob).cast(code).tolist()
    a = array(code)
    a.frombytes(blob)
    a.byteswap()
    return a.tolist()


def decode_ids(blob: bytes | None) -> list[int] | None:
    return None if blob is None else _unpack(_INT32, blob)


def decode_floats(blob: bytes | None) -> list[float] | None:
    return None if blob is None else _unpack("d", blob)


def decode_mask(blob: bytes | None) -> list[int] | None:
    if blob is None:
        return None
    return list(blob) if blob.isascii() else _unpack("b", blob)  # ascii: every byte is 0..127


_ENCODERS = {_INT32: encode_ids, "d": encode_floats, "b": encode_mask}


def decode_turn_arrays(prompt_ids: bytes | None, completion_ids: bytes | None, logprobs: bytes | None,
                       loss_mask: bytes | None) -> tuple[list[int] | None, list[int] | None, list[float] | None,
                                                      list[int] | None]:
    """The four stored columns of a turn as lists, the default mask filled in where it was left out."""
    prompt, completion = decode_ids(prompt_ids), decode_ids(completion_ids)
    mask = decode_mask(loss_mask)
    if mask is None and prompt is not None and completion is not None:
        mask = [0] * len(prompt) + [1] * len(completion)
    return prompt, completion, decode_floats(logprobs), mask


def turn_arrays_to_lists(columns: dict[str, Any]) -> dict[str, Any]:
    """Arrow BLOB columns of ``turns`` (one record batch) as the list columns they encode, for
    Parquet export: ``columns`` maps every name of :data:`BLOB_KINDS` to an Arrow array."""
    import pyarrow as pa

    decoded = [decode_turn_arrays(*row) for row in zip(*(columns[n].to_pylist() for n in BLOB_KINDS))]
    out = {}
    for i, name in enumerate(BLOB_KINDS):
        values = [row[i] for row in decoded]
        out[name] = pa.array(values, type=pa.list_({_INT32: pa.int32(), "d": pa.float64(), "b": pa.int8()}[
            BLOB_KINDS[name]]))
    return out


def list_column_to_blob(values: list[Any], name: str) -> list[bytes | None]:
    """Python lists read from an old ``LIST`` column as this module's BLOBs (schema migration)."""
    encode = _ENCODERS[BLOB_KINDS[name]]
    return [encode(v, name) for v in values]
