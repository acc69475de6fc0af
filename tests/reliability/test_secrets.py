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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import pytest

from closedloop.messages import (AssistantMessage, LogprobSpec, ToolCall, ToolMessage, Trajectory, Turn,
                                 UserMessage)
from closedloop.models import parse_spec
from closedloop.store import REDACTED, RunStore
from closedloop.store.batch import TOKEN_IDS_REDACTED
from closedloop.redact import might_hold_secret, redact, redact_message, redact_spec, redact_text
from closedloop.tool import ToolResult

SHORT_KEY = "sk-abc123"  # 6 characters after sk-: real test keys and proxies use these
URL_PASSWORD = "hunter2pass"
AT_PASSWORD = "p@ss-w0rd-at"  # an unescaped '@' in a password: urllib splits userinfo at the last '@'
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
    (f"http://bob:{AT_PASSWORD}@host:8/v1 and http://h/@me", "http://[REDACTED]@host:8/v1 and http://h/@me"),
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


# ---------------------------------------------------------------------- planted secrets, every output
#
# Secrets are planted in every field a write can carry, through every write path (synchronous,
# queued, bulk), and each registered *output* (what ends up on disk or on a terminal) is searched
# for them, as text and as byte-level token ids. To cover another output (a checkpoint directory,
# train_config.json, a server endpoint), register a function with ``@output("name")``: it gets the
# :class:`Planted` context (the secrets, an environment that carries them, a scratch directory and
# the planted store) and returns ``(label, bytes)`` pairs; an output must also show CANARY, the
# harmless text planted beside the secrets, so an output that lost everything cannot pass.

CANARY = "canary-visible-7731"
ENV_KEY = "zq-Unknown-Format-Value-8812"  # a key of no known shape: caught because the environment names it
PLANTED = {
    "sk key": SHORT_KEY, "url password with @": AT_PASSWORD, "url password": URL_PASSWORD, "query key": QUERY_KEY,
    "jwt": JWT, "pem": "MIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM2", "hex key": HEX_KEY, "env key": ENV_KEY,
    "bearer": "Zx9bearerTokenValue42", "hf token": "hf_" + "q" * 34, "github token": "ghp_" + "w" * 36,
    "aws key": "AKIAIOSFODNN7EXAMPLE", "password field": "plain-pw-value-77", "tag key": "sk-tagsecret99",
}
_LEAKS = {name: value for name, value in PLANTED.items()}
_LEAKS["half of the @ password"] = AT_PASSWORD.split("@")[1]  # what the old rule left behind


def _texts() -> dict[str, str]:
    """Text carrying the planted secrets, in the shapes they travel in. A bare 32-hex string is a
    key only outside message content (there it is a checksum a model reads back), so it is planted
    in configs, outcomes and errors."""
    return {
        "spec": f"openai:m@http://bob:{AT_PASSWORD}@127.0.0.1:9/v1?api_key={QUERY_KEY}",
        "prose": (f"{CANARY} key {SHORT_KEY}, url http://u:{URL_PASSWORD}@h/x, jwt {JWT}, env {ENV_KEY}, "
                  f"Authorization: Bearer {PLANTED['bearer']}, {PLANTED['hf token']} {PLANTED['github token']} "
                  f"{PLANTED['aws key']}\n{PEM}\nend"),
    }


@dataclass
class Planted:
    tmp_path: Path
    env: dict[str, str]
    store_path: Path
    run_ids: list[str] = field(default_factory=list)

    def cli(self, *argv: str) -> bytes:
        proc = subprocess.run([sys.executable, "-m", "closedloop", *argv], cwd=self.tmp_path, env=self.env,
                              capture_output=True, timeout=300)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
        return proc.stdout + proc.stderr


OUTPUTS: dict[str, Callable[[Planted], Iterable[tuple[str, bytes]]]] = {}


def output(name: str) -> Callable[[Callable[[Planted], Iterable[tuple[str, bytes]]]],
                                  Callable[[Planted], Iterable[tuple[str, bytes]]]]:
    def register(fn: Callable[[Planted], Iterable[tuple[str, bytes]]]) -> Callable[[Planted], Iterable[tuple[str, bytes]]]:
        OUTPUTS[name] = fn
        return fn
    return register


def _ids(text: str) -> list[int]:
    """A byte-level tokenizer (ids are UTF-8 bytes): decoding ids back is ``bytes(ids)``."""
    return list(text.encode())


def _plant(ctx: Planted) -> None:
    """Every write path, every field."""
    texts = _texts()
    prose, spec = texts["prose"], texts["spec"]
    store = RunStore(ctx.store_path)
    config = {"model": spec, "password": PLANTED["password field"], "note": prose, "hex": f"key {HEX_KEY}"}
    tags = [CANARY, f"deploy {PLANTED['tag key']}", f"password={PLANTED['password field']}"]
    call = ToolCall.make("fetch", {"url": f"http://u:{URL_PASSWORD}@h/x", "password": PLANTED["password field"],
                                   "note": prose})

    def turn(content: str) -> Turn:
        return Turn(message=AssistantMessage(content=content, tool_calls=[call]), model=f"m {SHORT_KEY}",
                    prompt_ids=_ids(f"system: {prose}"), completion_ids=_ids(content), completion_text=content,
                    logprob_spec=LogprobSpec(mode="server", backend=spec), unavailable={"logprobs": prose})

    def conversation(t: Turn) -> list:
        return [UserMessage(content=prose), t.message, ToolMessage(tool_call_id=call.id, content=prose)]

    # synchronous
    rid = store.start_run(kind="eval", graph="react", model_spec=spec, config=config, tags=tags,
                          metadata={"endpoint": spec, "token": PLANTED["password field"], "note": prose})
    first = turn(f"answer {CANARY} {prose}")
    store.log_messages(rid, conversation(first))
    store.log_turn(rid, first)
    store.log_tool_call(rid, call, ToolResult("fetch", prose, f"failed: {prose}", "exception"))
    store.log_metrics(rid, 0, {"loss": 1.0})
    store.finish_run(rid, status="failed", outcome={"answer": prose, "hex": HEX_KEY, "rewards": {"r": 1.0}},
                     error=RuntimeError(f"cannot reach {spec}: {prose} (key {HEX_KEY})"))
    # queued
    rid2 = store.start_run(kind="eval", graph="react", model_spec=spec, config=config, tags=tags)
    second = turn(f"queued {CANARY} {prose}")
    store.log_step(rid2, conversation(second), [second], [(call, ToolResult("fetch", prose), None)])
    store.log_metrics(rid2, 1, {"loss": 0.5}, wait=False)
    store.finish_run(rid2, outcome={"rewards": {"r": 0.0}})
    # bulk: two episodes of one task with different rewards, so pairs and groups have rows
    episodes = []
    for r in (1.0, 0.0):
        t = turn(f"bulk {CANARY} {prose}")
        episodes.append(Trajectory(messages=conversation(t), turns=[t], rewards={"r": r},
                                   metadata={"task_id": "t1", "note": prose}))
    ctx.run_ids = [rid, rid2, *store.record_trajectories(episodes, kind="train", model_spec=spec, config=config,
                                                           tags=tags)]
    store.close()


@pytest.fixture
def planted(tmp_path, monkeypatch) -> Planted:
    monkeypatch.setenv("SERVICE_API_KEY", ENV_KEY)  # as a user's shell would carry it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CLOSEDLOOP_HOME": str(tmp_path / "home")}
    ctx = Planted(tmp_path, env, tmp_path / "runs.duckdb")
    _plant(ctx)
    return ctx


def _leaks(blob: bytes) -> list[str]:
    return [name for name, value in _LEAKS.items() if value.encode() in blob]


def _id_bytes(value: object) -> bytes:
    """Every list of ints under ``value`` (token ids in JSON or Parquet) decoded as byte-level ids."""
    out = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack += list(v.values())
        elif isinstance(v, (list, tuple)):
            if v and all(isinstance(i, int) and 0 <= i < 256 for i in v):
                out.append(bytes(v))
            else:
                stack += list(v)
    return b"\0".join(out)


@output("store tables")
def _store_tables(ctx: Planted) -> Iterable[tuple[str, bytes]]:
    """Every value of every table, as DuckDB returns it; the id BLOBs decoded to their ids."""
    import duckdb

    from closedloop.store.codec import decode_ids

    with duckdb.connect(str(ctx.store_path), read_only=True) as con:
        for (table,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall():
            cur = con.execute(f"SELECT * FROM {table}")
            names = [d[0] for d in cur.description]
            for row in cur.fetchall():
                for name, value in zip(names, row):
                    if name in ("prompt_ids", "completion_ids"):
                        yield f"{table}.{name}", bytes(decode_ids(value) or [])
                    else:
                        yield f"{table}.{name}", str(value).encode()


@output("store file bytes")
def _store_file(ctx: Planted) -> Iterable[tuple[str, bytes]]:
    for path in ctx.store_path.parent.glob(ctx.store_path.name + "*"):
        yield path.name, path.read_bytes()


@output("parquet export")
def _parquet(ctx: Planted) -> Iterable[tuple[str, bytes]]:
    import pyarrow.parquet as pq

    ctx.cli("runs", "export", "--parquet", str(ctx.tmp_path / "pq"), "--store", str(ctx.store_path))
    for path in sorted((ctx.tmp_path / "pq").iterdir()):
        rows = pq.read_table(path).to_pylist()
        yield path.name, path.read_bytes() + json.dumps(rows, default=str).encode() + _id_bytes(rows)


@output("runs show")
def _runs_show(ctx: Planted) -> Iterable[tuple[str, bytes]]:
    for rid in ctx.run_ids:
        yield f"show {rid}", ctx.cli("runs", "show", rid, "--store", str(ctx.store_path))
        shown = ctx.cli("runs", "show", rid, "--json", "--store", str(ctx.store_path))
        yield f"show --json {rid}", shown + _id_bytes(json.loads(shown))
    yield "list --json", ctx.cli("runs", "list", "--json", "--store", str(ctx.store_path))


@output("runs export")
def _runs_export(ctx: Planted) -> Iterable[tuple[str, bytes]]:
    for fmt in ("sft", "pairs", "groups"):
        out = ctx.tmp_path / f"{fmt}.jsonl"
        printed = ctx.cli("runs", "export", "--format", fmt, "--out", str(out), "--status", "any",
                          "--store", str(ctx.store_path))
        body = out.read_bytes()
        yield f"export {fmt}", printed + body + _id_bytes([json.loads(line) for line in body.splitlines()])


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_no_planted_secret_reaches_an_output(planted, name):
    seen = list(OUTPUTS[name](planted))
    leaks = sorted({f"{what} in {label}" for label, blob in seen for what in _leaks(blob)})
    assert leaks == []
    assert any(CANARY.encode() in blob for _, blob in seen), f"{name} shows nothing planted: the check is vacuous"


def test_turns_keep_no_token_ids_that_decode_to_a_redacted_key(planted):
    """The turns' text says [REDACTED]; their ids would decode back to the key, so they are gone,
    and the turn says why: a trainer skips it (untrainable) and can report the reason."""
    store = RunStore(planted.store_path)
    for rid in planted.run_ids:
        rec = store.get_run(rid)
        assert rec.secrets_redacted and rec.turns
        for t in rec.turns:
            assert (t.prompt_ids, t.completion_ids, t.logprobs, t.trainable) == (None, None, None, False)
            assert t.unavailable["token_ids"] == TOKEN_IDS_REDACTED and REDACTED in t.message.text
            assert t.usage.prompt_tokens > 0  # counts stay
        assert rec.to_trajectory().token_view() == []  # untrainable turns are skipped, not trained on


def test_a_turn_before_the_first_secret_keeps_its_ids(tmp_path):
    """Only turns whose prompt or completion held the removed text lose their ids."""
    store = RunStore(tmp_path / "runs.duckdb")
    clean = Turn(message=AssistantMessage(content="hello"), prompt_ids=_ids("hi"), completion_ids=_ids("hello"))
    leaky = Turn(message=AssistantMessage(content="done"), prompt_ids=_ids(f"hi hello {SHORT_KEY}"),
                 completion_ids=_ids("done"))
    messages = [UserMessage(content="hi"), clean.message, ToolMessage(tool_call_id="c", content=SHORT_KEY),
                leaky.message]
    [bulk] = store.record_trajectories([Trajectory(messages=messages, turns=[clean, leaky])])
    rid = store.start_run()
    store.log_turn(rid, clean)
    store.log_messages(rid, messages[2:3])
    store.log_turn(rid, leaky)  # a later call of the same run: the run remembers
    store.log_turn(rid, clean)
    for run_id, expected in ((bulk, [True, False]), (rid, [True, False, False])):
        assert [t.has_tokens for t in store.get_run(run_id).turns] == expected
    assert store.get_run(rid).turns[0].prompt_ids == _ids("hi")
