"""Secrets never reach the store: not in configs, metadata, messages, tool calls, errors or exports."""

from __future__ import annotations

import json

import duckdb
import pytest

from closedloop.messages import AssistantMessage, LogprobSpec, ToolCall, ToolMessage, Turn, UserMessage
from closedloop.store import REDACTED, RunStore, redact, redact_text
from closedloop.redact import is_sensitive_key, redact_arguments
from closedloop.store.batch import TOKEN_IDS_REDACTED
from closedloop.tool import ToolResult

OPENAI_KEY = "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0" * 2
HF_TOKEN = "hf_" + "abcdefghijklmnopqrstuvwxyzABCDEF"


@pytest.mark.parametrize("key", ["api_key", "OPENAI_API_KEY", "apiKey", "x-api-key", "HF_TOKEN", "accessToken",
                                 "token", "client_secret", "Authorization", "password", "db_password",
                                 "aws_secret_access_key"])
def test_sensitive_keys(key):
    assert is_sensitive_key(key)


@pytest.mark.parametrize("key", ["max_tokens", "prompt_tokens", "completion_tokens", "tokenizer", "num_tokens",
                                 "model", "temperature", "keyboard", "author"])
def test_keys_we_must_keep(key):
    assert not is_sensitive_key(key)


def test_redact_nested_values_and_strings():
    cfg = {"model": "gpt", "max_tokens": 64, "client": {"api_key": "abc", "headers": {"Authorization": "Bearer xyz123456789"}},
           "notes": [f"key was {OPENAI_KEY} oops", "Bearer abcdefgh12345678", "nothing here"], "hf_token": None}
    out = redact(cfg)
    assert out["model"] == "gpt" and out["max_tokens"] == 64
    assert out["client"] == {"api_key": REDACTED, "headers": {"Authorization": REDACTED}}
    assert out["notes"] == [f"key was {REDACTED} oops", REDACTED, "nothing here"]
    assert out["hf_token"] is None  # nothing to hide; keeps "unset" visible


def test_redact_text_key_values_and_code():
    assert redact_text("login failed: password=hunter22; user=bob") == f"login failed: password={REDACTED}; user=bob"
    assert redact_text('{"api_key": "abc123xyz"}') == f'{{"api_key": "{REDACTED}"}}'
    code = "for token in tokens:\n    max_tokens = 5"
    assert redact_text(code, key_values=False) == code
    assert redact_text(f"HF says no: {HF_TOKEN}", key_values=False) == f"HF says no: {REDACTED}"


def test_outcome_keeps_reward_names_but_not_secrets(tmp_path):
    store = RunStore(tmp_path / "runs.duckdb")
    rid = store.start_run()
    store.finish_run(rid, outcome={"rewards": {"token_f1": 0.75}, "answer": f"use {OPENAI_KEY}"})
    rec = store.get_run(rid)
    assert rec.outcome == {"rewards": {"token_f1": 0.75}, "answer": f"use {REDACTED}"}
    assert store.load_trajectory(rid).rewards == {"token_f1": 0.75}


def test_env_secret_values_are_redacted_even_without_a_known_shape(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "plainvalue-42-zz")
    assert redact_text("called with plainvalue-42-zz", key_values=False) == f"called with {REDACTED}"


def test_arguments_kept_verbatim_unless_redacted():
    raw = '{"a":1,  "b": "x"}'
    assert redact_arguments(raw) == raw
    assert REDACTED in redact_arguments('{"password": "p", "user": "u"}')
    assert redact_arguments(f"{{not json {OPENAI_KEY}") == f"{{not json {REDACTED}"


def test_no_secret_anywhere_in_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", OPENAI_KEY)
    store = RunStore(tmp_path / "runs.duckdb")
    call = ToolCall.make("login", {"user": "bob", "password": "hunter22-secret"})
    with pytest.raises(RuntimeError):
        with store.run(config={"model": "gpt", "api_key": OPENAI_KEY, "headers": {"Authorization": f"Bearer {OPENAI_KEY}"}},
                       metadata={"hf_token": HF_TOKEN, "note": f"from {HF_TOKEN}"}) as run:
            run.log_messages([UserMessage(content=f"my key is {OPENAI_KEY}"),
                              AssistantMessage(content="calling", tool_calls=[call]),
                              ToolMessage(tool_call_id=call.id, content="denied", error=f"auth failed for {OPENAI_KEY}")])
            run.log_turn(Turn(message=AssistantMessage(content=f"echo {OPENAI_KEY}"), completion_text=f"echo {OPENAI_KEY}"))
            run.log_tool_call(call, ToolResult("login", f"Error: bad key {OPENAI_KEY}", error=f"401 for {OPENAI_KEY}",
                                               error_kind="exception"))
            raise RuntimeError(f"Incorrect API key provided: {OPENAI_KEY} (Authorization: Bearer {OPENAI_KEY})")
    rec = store.get_run(run.id)
    assert rec.config["model"] == "gpt" and rec.config["api_key"] == REDACTED
    assert rec.metadata == {"hf_token": REDACTED, "note": f"from {REDACTED}"}
    assert "Incorrect API key provided" in rec.error and rec.status == "failed"
    assert rec.tool_calls[0].arguments == f'{{"user": "bob", "password": "{REDACTED}"}}'

    # The raw bytes of the database and of an export contain none of the secrets.
    store.export_parquet(tmp_path / "pq")
    con = duckdb.connect(str(tmp_path / "runs.duckdb"), read_only=True)
    dumped = "".join(str(row) for t in ("runs", "messages", "turns", "tool_calls")
                     for row in con.execute(f"SELECT * FROM {t}").fetchall())
    con.close()
    for secret in (OPENAI_KEY, HF_TOKEN, "hunter22-secret"):
        assert secret not in dumped
        assert secret.encode() not in (tmp_path / "runs.duckdb").read_bytes()
        for f in (tmp_path / "pq").iterdir():
            assert secret.encode() not in f.read_bytes()
    assert dumped.count(REDACTED) >= 10


_SAMPLES = [OPENAI_KEY, HF_TOKEN, "Bearer abcdefgh12345678", "ghp_" + "a" * 36, "AKIA" + "B" * 16,
            "xoxb-1234567890-abc", "AIza" + "c" * 35]


@pytest.mark.parametrize("text", [f"see {s} here" for s in _SAMPLES] + [
    '{"api_key": "abc"}', '{"apiKey": "abc"}', '{"x-api-key": "v"}', '{"password": "p"}', '{"Authorization": "x"}',
    '{"client_secret": "s"}', '{"access_key": "k"}', "HF_TOKEN: xyz"])
def test_the_fast_check_flags_everything_a_rule_would_change(text):
    from closedloop.redact import might_hold_secret

    changed = redact_text(text) != text or redact_arguments(text) != text
    assert changed and might_hold_secret(text, [])
    assert might_hold_secret(json.dumps({"content": text}), [])  # also inside serialised JSON


def test_the_fast_check_passes_plain_text_and_checks_env_secrets():
    from closedloop.redact import might_hold_secret

    plain = '{"role": "assistant", "content": "The sum is 7.", "tool_calls": null}'
    assert not might_hold_secret(plain, [])
    assert might_hold_secret(plain.replace("sum", "plainvalue-42-zz"), ["plainvalue-42-zz"])
    assert might_hold_secret(plain, ['needs"escaping'])  # unknown JSON form: always take the full path


@pytest.mark.parametrize("path", ["record_trajectories", "log_step"])
def test_bulk_and_queued_writes_redact_like_direct_ones(tmp_path, monkeypatch, path):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "plainvalue-42-zz")
    call = ToolCall.make("login", {"user": "bob", "password": "hunter22-secret"})
    turn = Turn(message=AssistantMessage(content=f"echo {OPENAI_KEY}", tool_calls=[call]),
                completion_text=f"echo {OPENAI_KEY} plainvalue-42-zz", prompt_ids=[1], completion_ids=[2],
                model="proxy-plainvalue-42-zz", logprob_spec=LogprobSpec(mode="server", backend=f"gw {HF_TOKEN}"),
                unavailable={"logprobs": f"401: {OPENAI_KEY}", "token_ids": "not returned"})
    messages = [UserMessage(content=f"my key is {HF_TOKEN}"), turn.message,
                ToolMessage(tool_call_id=call.id, content="ok plainvalue-42-zz"), AssistantMessage(content="plain")]
    store = RunStore(tmp_path / "runs.duckdb")
    if path == "record_trajectories":
        from closedloop.messages import Trajectory

        [rid] = store.record_trajectories([Trajectory(messages=messages, turns=[turn])])
    else:
        rid = store.start_run()
        store.log_step(rid, messages, [turn], [(call, ToolResult("login", f"bad {OPENAI_KEY}"), None)])
        store.finish_run(rid)
    rec = store.get_run(rid)
    assert rec.messages[-1].text == "plain" and rec.messages[0].text == f"my key is {REDACTED}"
    assert json.loads(rec.turns[0].message.tool_calls[0].function.arguments)["password"] == REDACTED
    t = rec.turns[0]  # the turn's short text fields too; field names such as "token_ids" are kept
    assert t.unavailable == {"logprobs": f"401: {REDACTED}", "token_ids": TOKEN_IDS_REDACTED}
    assert (t.model, t.logprob_spec.backend) == (f"proxy-{REDACTED}", f"gw {REDACTED}")
    # its ids would decode back to the key: gone, and the turn says why (see test_secrets.py)
    assert (t.prompt_ids, t.completion_ids, t.trainable) == (None, None, False) and rec.secrets_redacted
    store.close()
    raw = (tmp_path / "runs.duckdb").read_bytes()
    for secret in (OPENAI_KEY, HF_TOKEN, "hunter22-secret", "plainvalue-42-zz"):
        assert secret.encode() not in raw
