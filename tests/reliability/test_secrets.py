"""Keys in odd places never reach the store, an export or the terminal.

Issue 9 (5): a key inside a model spec URL (``openai:m@http://user:sk-...@host/v1``,
``?api_key=...``) was stored in ``runs.model_spec``, ``config``, ``outcome``, ``error`` and
``results.json`` and printed; keys shorter than 16 characters after ``sk-`` were missed. Issue 11:
JWTs, PEM blocks and 32-hex keys are caught, base64 media is left alone.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from closedloop.models import parse_spec
from closedloop.store import REDACTED, RunStore
from closedloop.store.redact import might_hold_secret, redact, redact_message, redact_spec, redact_text

SHORT_KEY = "sk-abc123"  # 6 characters after sk-: real test keys and proxies use these
URL_PASSWORD = "hunter2pass"
QUERY_KEY = "qk-778899xyz"
SPEC = f"openai:m@http://user:{SHORT_KEY}@127.0.0.1:9/v1?api_key={QUERY_KEY}&timeout=5"
JWT = ("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkFsaWNlIn0."
       "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c")
PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM2\nc2VjcmV0\n-----END RSA PRIVATE KEY-----"
HEX_KEY = "3f1b6c8e2d4a5b7c9e0f1a2b3c4d5e6f"  # 32 hex, not a version-4 UUID (13th digit is not 4)
SECRETS = (SHORT_KEY, URL_PASSWORD, QUERY_KEY, JWT, "MIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM2", HEX_KEY)


@pytest.mark.parametrize("text, kept", [
    (SPEC, "openai:m@http://[REDACTED]@127.0.0.1:9/v1?api_key=[REDACTED]&timeout=5"),
    (f"http://bob:{URL_PASSWORD}@host/x", "http://[REDACTED]@host/x"),
    (f"https://host/v1?token={QUERY_KEY}", "https://host/v1?token=[REDACTED]"),
    (f"https://host/v1?key={QUERY_KEY}&sig=abcdef", "https://host/v1?key=[REDACTED]&sig=[REDACTED]"),
    (f"use {SHORT_KEY} here", "use [REDACTED] here"),
    (f"auth {JWT} ok", "auth [REDACTED] ok"),
    (f"cert:\n{PEM}\nend", "cert:\n[REDACTED]\nend"),
    (f"key {HEX_KEY}.", "key [REDACTED]."),
    ("X-API-Key: abcdef12345", "X-API-Key: [REDACTED]"),
    ('-H "Authorization: Basic dXNlcjpwYXNzd29yZA=="', '-H "Authorization: [REDACTED]"'),
])
def test_credential_shapes_are_redacted_in_every_mode(text, kept):
    assert redact_text(text) == kept
    assert redact_text(text, key_values=False) == kept  # outcomes and messages get the pattern rules too
    assert might_hold_secret(text, []) and might_hold_secret(json.dumps({"t": text}), [])


@pytest.mark.parametrize("text", [
    "sk-SK locale", "task-force", "max_tokens=64", "thread 9c2e7b1d4f3a4e6b8a1c2d3e4f5a6b7c",  # a uuid4().hex
    "sha1 " + "a" * 40, "sha256 " + "b" * 64, "chatcmpl-" + "3f1b6c8e2d4a5b7c9e0f1a2b3c4d5e6f", "0x" + HEX_KEY,
    "http://host:8000/v1", "mail bob@example.com", "https://example.com/?page=2&q=tokens"])
def test_lookalikes_are_kept(text):
    assert redact_text(text) == text


def test_truncated_pem_block_is_redacted_to_the_end():
    head = PEM.split("-----END")[0]
    assert redact_text("error tail: " + head) == "error tail: " + REDACTED


def test_base64_media_is_never_mangled():
    blob = base64.b64encode(os.urandom(6000) + b"api_key=Token=sk-abcdef").decode()
    data_url = "data:image/png;base64," + blob
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                           {"type": "input_audio", "input_audio": {"data": blob, "format": "wav"}},
                                           {"type": "text", "text": f"and {SHORT_KEY}"}]}
    out = redact(message)
    assert out["content"][0]["image_url"]["url"] == data_url
    assert out["content"][1]["input_audio"]["data"] == blob
    assert out["content"][2]["text"] == f"and {REDACTED}"
    assert redact_message(message)["content"][0]["image_url"]["url"] == data_url
    assert redact_text(f"x {data_url} api_key=abcdefgh") == f"x {data_url} api_key={REDACTED}"


def test_message_content_keeps_hex_checksums():
    assert redact_message({"role": "tool", "content": f"md5 {HEX_KEY}"})["content"] == f"md5 {HEX_KEY}"


def test_spec_printing_is_redacted():
    printed = str(parse_spec(SPEC))
    assert SHORT_KEY not in printed and QUERY_KEY not in printed and "127.0.0.1:9/v1" in printed
    assert parse_spec(SPEC).base_url.startswith(f"http://user:{SHORT_KEY}@")  # the client still gets the key
    assert redact_spec(None) is None
    with pytest.raises(ValueError) as info:  # a typo'd spec: the error (printed by the CLI) is redacted too
        parse_spec(SPEC.replace("http://", "ftp://"))
    assert SHORT_KEY not in str(info.value) and QUERY_KEY not in str(info.value)


def _secrets_in(blob: bytes) -> list[str]:
    return [s for s in SECRETS if s.encode() in blob]


def test_store_and_export_hold_no_key_after_runs_with_keys_in_the_spec(tmp_path):
    store = RunStore(tmp_path / "runs.duckdb")
    rid = store.start_run(graph="react", model_spec=SPEC, config={"model": SPEC, "auth": JWT, "note": PEM},
                          metadata={"endpoint": SPEC})
    store.finish_run(rid, status="failed", outcome={"answer": f"spec was {SPEC}", "hex": HEX_KEY},
                     error=RuntimeError(f"cannot reach {SPEC}; token {JWT}"))
    from closedloop.messages import Trajectory, UserMessage

    [rid2] = store.record_trajectories([Trajectory(messages=[UserMessage(content=f"hi {SHORT_KEY}")])],
                                       model_spec=SPEC, config={"model": SPEC})
    rec = store.get_run(rid)
    assert rec.model_spec == redact_spec(SPEC) and "127.0.0.1:9/v1" in rec.model_spec
    assert store.get_run(rid2).model_spec == rec.model_spec
    assert [r.id for r in store.iter_trajectories(model_spec=SPEC)]  # the filter is redacted the same way
    store.export_parquet(tmp_path / "pq")
    store.close()
    assert _secrets_in((tmp_path / "runs.duckdb").read_bytes()) == []
    for f in (tmp_path / "pq").iterdir():
        assert _secrets_in(f.read_bytes()) == []

    from closedloop.evals.tau.results import RunInfo, write_results

    info = RunInfo(agent_info={"implementation": "react", "llm": SPEC}, user_info={"llm": SPEC},
                   environment_info={"eval_run_id": rid})
    path = write_results(tmp_path / "results.json", [], [], info)
    exported = json.loads(path.read_text())
    assert _secrets_in(path.read_bytes()) == []
    assert exported["info"]["environment_info"]["eval_run_id"] == rid  # run ids (uuid4 hex) survive


def test_cli_run_with_keys_in_the_spec_prints_and_stores_none(tmp_path):
    """The real CLI against a refused port: the error it prints and everything it stores are clean."""
    env = {**os.environ, "CLOSEDLOOP_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "closedloop", "run", "react", "--model", SPEC, "--input", "3+4?"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "cannot reach" in proc.stdout + proc.stderr
    assert _secrets_in((proc.stdout + proc.stderr).encode()) == []
    listed = subprocess.run([sys.executable, "-m", "closedloop", "runs", "list", "--json"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert json.loads(listed.stdout)[0]["model_spec"] == redact_spec(SPEC)
    db = Path(tmp_path / "home" / "runs.duckdb")
    assert _secrets_in(db.read_bytes()) == []
