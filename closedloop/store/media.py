"""Images and audio of stored messages as content-addressed artifacts, not base64 inside rows.

Why: a multimodal episode repeats its pictures in every message list it is recorded with (and
every run of the same task repeats them again), and a base64 payload is a third larger than its
bytes; rows that carry it make every scan of ``messages`` (listing, exports, secret checks) pay
for megabytes nobody reads. So a write replaces each image/audio part's payload with a reference
and puts the bytes in the ``media`` table once (keyed by sha256, shared by every run);
``run_media`` says which runs use which hash, so deleting runs can drop media nobody uses.

References (inside the stored message JSON, never seen by a caller unless asked for):

- image: ``{"type": "image_url", "image_url": {"url": "closedloop-media:sha256:<hex>;mime=<mime>"}}``
  for a ``data:<mime>;base64,<payload>`` URL (``detail`` is kept as it was);
- audio: ``{"type": "input_audio", "input_audio": {"data": "closedloop-media:sha256:<hex>", "format": ...}}``.

A read restores the part exactly: only payloads that are canonical base64 (what
``base64.b64encode`` writes, as :meth:`ImagePart.from_bytes` does) are moved out, so re-encoding
the stored bytes gives the same characters back; anything else (an ``http`` URL, a data URL with
extra parameters, base64 with line breaks) stays inline, as before. References are found and
restored structurally (the message's content parts), so text that merely mentions
``closedloop-media:`` is never touched.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping

import duckdb

__all__ = ["REF_PREFIX", "MediaMode", "MediaMissingError", "MediaSink", "might_hold_media", "might_hold_refs",
           "externalize_json", "referenced_hashes", "fetch_media", "restore_json", "Restorer", "write_media",
           "MEDIA_TABLES"]

REF_PREFIX = "closedloop-media:sha256:"
MediaMode = Literal["inline", "refs"]
# Two tables: the bytes once per hash, and which runs reference which hash (for retention).
# ``sha256`` is the key, kept unique by the writer (it inserts only hashes the table lacks), not
# declared: DuckDB checks a PRIMARY KEY against concurrently committed rows and fails the second
# of two transactions storing one picture, and a store's threads do that (a retry would too).
# Two such threads may each store a copy; readers take either (they are equal), retention drops both.
MEDIA_TABLES = (
    """CREATE TABLE IF NOT EXISTS media (
        sha256 VARCHAR NOT NULL,
        mime VARCHAR,
        size BIGINT NOT NULL,
        data BLOB NOT NULL,
        created_at TIMESTAMP NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS run_media (
        run_id VARCHAR NOT NULL,
        sha256 VARCHAR NOT NULL
    )""",
)
_DATA_URL = re.compile(r"data:([^;,]*);base64,")
_REF_URL = re.compile(r"closedloop-media:sha256:([0-9a-f]{64})(?:;mime=([^;,]*))?\Z")
_REF_HASH = re.compile(r"closedloop-media:sha256:([0-9a-f]{64})")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


class MediaMissingError(LookupError):
    """A stored message references media the ``media`` table no longer holds."""


@dataclass(slots=True)
class MediaSink:
    """Media bytes collected while rows are prepared, written in the rows' transaction.

    ``blobs``: sha256 -> (mime, bytes), each hash once. ``pending``: hashes seen since the last
    :meth:`take`, so the caller can tie them to the run it is preparing."""

    blobs: dict[str, tuple[str | None, bytes]] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)

    def add(self, data: bytes, mime: str | None) -> str:
        digest = hashlib.sha256(data).hexdigest()
        if digest not in self.blobs:
            self.blobs[digest] = (mime, data)
        self.pending.add(digest)
        return digest

    def take(self) -> set[str]:
        out, self.pending = self.pending, set()
        return out


def might_hold_media(text: str) -> bool:
    """Cheap and conservative: False when a message's JSON cannot hold an image or audio part.

    A part's key is a JSON key (``"image_url"`` with bare quotes); the same word inside a text
    value is escaped (``\\"image_url\\"``), so free text never answers True by quoting it."""
    return '"image_url"' in text or '"input_audio"' in text


def might_hold_refs(text: str) -> bool:
    return REF_PREFIX in text


def _canonical_b64(payload: str) -> bytes | None:
    """The bytes of ``payload`` if re-encoding them gives ``payload`` back exactly, else None."""
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None
    return data if base64.b64encode(data).decode("ascii") == payload else None


def _parts(message: Any) -> Iterable[dict[str, Any]]:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                yield part


def _dumps(message: Any) -> str:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False)


def externalize_json(text: str, sink: MediaSink) -> str:
    """One message's JSON with its image/audio payloads replaced by references (bytes to ``sink``);
    ``text`` itself when it has none to move."""
    if not might_hold_media(text):
        return text
    message = json.loads(text)
    changed = False
    for part in _parts(message):
        kind = part.get("type")
        if kind == "image_url" and isinstance(part.get("image_url"), dict):
            image = part["image_url"]
            url = image.get("url")
            m = _DATA_URL.match(url) if isinstance(url, str) else None
            if m is None:
                continue
            data = _canonical_b64(url[m.end():])
            if data is None:
                continue
            image["url"] = f"{REF_PREFIX}{sink.add(data, m.group(1) or None)};mime={m.group(1)}"
            changed = True
        elif kind == "input_audio" and isinstance(part.get("input_audio"), dict):
            audio = part["input_audio"]
            payload = audio.get("data")
            data = _canonical_b64(payload) if isinstance(payload, str) else None
            if data is None:
                continue
            fmt = audio.get("format")
            audio["data"] = REF_PREFIX + sink.add(data, f"audio/{fmt}" if isinstance(fmt, str) and fmt else None)
            changed = True
    return _dumps(message) if changed else text


def referenced_hashes(texts: Iterable[str | None]) -> set[str]:
    """Every hash a reference in these JSON texts may name (a superset: read, then restored structurally)."""
    out: set[str] = set()
    for text in texts:
        if text is not None and REF_PREFIX in text:
            out.update(_REF_HASH.findall(text))
    return out


def fetch_media(con: duckdb.DuckDBPyConnection, hashes: Iterable[str]) -> dict[str, bytes]:
    wanted = sorted(h for h in set(hashes) if _HEX64.match(h))
    if not wanted:
        return {}
    return dict(con.execute("SELECT sha256, any_value(data) FROM media WHERE sha256 IN "
                            "(SELECT unnest(?::VARCHAR[])) GROUP BY sha256", [wanted]).fetchall())


class Restorer:
    """Restores references in JSON texts from fetched bytes; each blob is base64-encoded once."""

    def __init__(self, blobs: Mapping[str, bytes]) -> None:
        self.blobs = blobs
        self._b64: dict[str, str] = {}

    def _payload(self, digest: str) -> str:
        b64 = self._b64.get(digest)
        if b64 is None:
            data = self.blobs.get(digest)
            if data is None:
                raise MediaMissingError(f"media sha256:{digest} is referenced by a stored message but missing from "
                                        f"the run store's media table")
            b64 = self._b64[digest] = base64.b64encode(data).decode("ascii")
        return b64

    def __call__(self, text: str) -> str:
        if REF_PREFIX not in text:
            return text
        message = json.loads(text)
        changed = False
        for part in _parts(message):
            kind = part.get("type")
            if kind == "image_url" and isinstance(part.get("image_url"), dict):
                url = part["image_url"].get("url")
                m = _REF_URL.match(url) if isinstance(url, str) else None
                if m is not None:
                    part["image_url"]["url"] = f"data:{m.group(2) or ''};base64,{self._payload(m.group(1))}"
                    changed = True
            elif kind == "input_audio" and isinstance(part.get("input_audio"), dict):
                data = part["input_audio"].get("data")
                if isinstance(data, str) and data.startswith(REF_PREFIX) and _HEX64.match(data[len(REF_PREFIX):]):
                    part["input_audio"]["data"] = self._payload(data[len(REF_PREFIX):])
                    changed = True
        return _dumps(message) if changed else text


def restore_json(text: str, blobs: Mapping[str, bytes]) -> str:
    """``text`` with every reference replaced by its original payload."""
    return Restorer(blobs)(text)


def write_media(con: duckdb.DuckDBPyConnection, sink: MediaSink, run_refs: Iterable[tuple[str, str]],
                now: Any) -> None:
    """Insert the sink's blobs the store lacks and the (run, hash) pairs it lacks, inside the
    caller's transaction (hashes already stored are not sent again: one lookup)."""
    if sink.blobs:
        have = {r[0] for r in con.execute("SELECT sha256 FROM media WHERE sha256 IN (SELECT unnest(?::VARCHAR[]))",
                                          [list(sink.blobs)]).fetchall()}
        new = [(h, mime, len(data), data, now) for h, (mime, data) in sink.blobs.items() if h not in have]
        if new:
            con.executemany("INSERT INTO media (sha256, mime, size, data, created_at) VALUES (?, ?, ?, ?, ?)", new)
    pairs = sorted(set(run_refs))
    if pairs:
        con.execute("INSERT INTO run_media SELECT DISTINCT p.run_id, p.sha256 FROM "
                    "(SELECT unnest(?::VARCHAR[]) AS run_id, unnest(?::VARCHAR[]) AS sha256) AS p "
                    "WHERE NOT EXISTS (SELECT 1 FROM run_media r WHERE r.run_id = p.run_id AND r.sha256 = p.sha256)",
                    [[p[0] for p in pairs], [p[1] for p in pairs]])


def collect_garbage(con: duckdb.DuckDBPyConnection, run_ids: list[str]) -> int:
    """Forget these runs' references and delete media no remaining run references; returns how many blobs went."""
    row = con.execute("DELETE FROM run_media WHERE list_contains(?, run_id)", [run_ids]).fetchone()
    if not row or not row[0]:
        return 0
    row = con.execute("DELETE FROM media WHERE sha256 NOT IN (SELECT sha256 FROM run_media)").fetchone()
    return int(row[0]) if row and row[0] else 0
