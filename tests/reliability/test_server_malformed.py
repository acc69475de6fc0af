"""Issue 9, finding 14 (and its relatives): bodies that ``json.loads`` accepts, or half-accepts, but
no request may hold are a 400 in OpenAI's error shape, never a 500.

Deep nesting made ``json.loads`` raise ``RecursionError``; a lone UTF-16 surrogate parsed fine and
failed later when something encoded it; ``NaN``/``Infinity``/``1e400`` slipped through as floats; a
5,000-digit integer raised Python's int-digits ``ValueError``; a seed above 2**64 overflowed torch.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from closedloop.models.hf import HFClient
from closedloop.server import create_app
from closedloop.server.local import serve_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(tiny_model_path):
    torch.set_num_threads(1)
    client = HFClient.from_pretrained(tiny_model_path, batch_wait_ms=5)
    with serve_app(create_app(client, "tiny", default_max_tokens=4, max_tokens_cap=16)) as base:
        yield base


def _raw(url: str, body: bytes | str) -> httpx.Response:
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    return httpx.post(f"{url}/chat/completions", content=data, timeout=60,
                      headers={"content-type": "application/json"})


def _assert_openai_400(r: httpx.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    return err


MSG = '[{"role": "user", "content": "Hi"}]'


@pytest.mark.parametrize("depth", [65, 5_000, 200_000])
def test_deeply_nested_bodies_are_400(url, depth):
    nested = "[" * depth + "]" * depth
    err = _assert_openai_400(_raw(url, f'{{"model": "tiny", "messages": {MSG}, "extra": {nested}}}'))
    assert "nested" in err["message"]


def test_ordinary_nesting_is_fine(url):
    inner = {"type": "object", "properties": {"b": {"type": "array", "items": {"type": "string"}}}}
    schema = {"type": "object", "properties": {"a": inner}}
    r = httpx.post(f"{url}/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("where", [
    '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    '{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
    '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
    '{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stop": ["\\ud800"]}',
    '{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", '
    '"function": {"name": "f", "description": "\\udc00"}}]}',
    '{"model": "tiny", "messages": [{"role": "user", "content": "Hi", "\\ud800": 1}]}',
])
def test_lone_surrogates_are_400(url, where):
    err = _assert_openai_400(_raw(url, where))
    assert "surrogate" in err["message"]


def test_a_valid_surrogate_pair_is_an_ordinary_character(url):
    r = _raw(url, '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [
    f'{{"model": "tiny", "messages": {MSG}, "temperature": NaN}}',
    f'{{"model": "tiny", "messages": {MSG}, "temperature": Infinity}}',
    f'{{"model": "tiny", "messages": {MSG}, "top_p": -Infinity}}',
    f'{{"model": "tiny", "messages": {MSG}, "temperature": 1e400}}',
    f'{{"model": "tiny", "messages": {MSG}, "seed": {"9" * 5000}}}',
    f'{{"model": "tiny", "messages": {MSG}, "seed": {2 ** 64}}}',
    f'{{"model": "tiny", "messages": {MSG}, "n": {10 ** 30}}}',
    f'{{"model": "tiny", "messages": {MSG}, "max_tokens": {10 ** 30}}}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b'\x00\x01',
    '[1, 2]',
    '"just a string"',
    '',
])
def test_odd_numbers_and_encodings_are_400(url, body):
    _assert_openai_400(_raw(url, body))


def test_the_largest_seed_works(url):
    r = httpx.post(f"{url}/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2,
        "seed": 2 ** 63 - 1})
    assert r.status_code == 200, r.text
