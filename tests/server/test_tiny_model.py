"""The real stack: the tiny transformer behind ``python -m closedloop serve`` (a subprocess, the
same command a user runs), driven over HTTP by the ``openai:`` backend and by raw httpx.

The checkpoint is built once per version of ``tiny.py`` and kept in pytest's cache
(``CLOSEDLOOP_TINY_MODEL`` points at a prebuilt one instead), because building it trains for a
minute or more on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("closedloop.models.hf", reason="the hf: backend is not built yet")

from closedloop.messages import ToolMessage, UserMessage  # noqa: E402
from closedloop.models import GenerateRequest, SamplingParams, TextDelta, TurnDone  # noqa: E402
from closedloop.models.openai_client import OpenAIClient  # noqa: E402

from .conftest import free_port  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_path(tiny_model_path) -> Path:
    return tiny_model_path


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="module")
def cli_server_process(tiny_path):
    """``closedloop serve`` as a user starts it; yields the process and the base URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "closedloop", "serve", "--model", f"hf:{tiny_path}",
                             "--port", str(port), "--served-name", "tiny", "--max-tokens", "48",
                             "--torch-threads", "1", "--max-batch-size", "8"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"closedloop serve exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("closedloop serve did not come up in 120 s")
        time.sleep(0.2)
    yield proc, url
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def cli_server(cli_server_process):
    """The base URL of ``closedloop serve``."""
    return cli_server_process[1]


@pytest.fixture
async def client(cli_server):
    c = OpenAIClient("tiny", base_url=cli_server)
    yield c
    await c.aclose()


def weather_tool() -> dict:
    from closedloop.models.tiny import tool_schemas

    return tool_schemas()["get_weather"]


GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


def test_models_endpoint_names_the_served_model(cli_server):
    assert [m["id"] for m in httpx.get(f"{cli_server}/models").json()["data"]] == ["tiny"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="CPU binding needs Linux and two CPUs")
def test_the_engine_and_the_server_run_on_separate_cpus(cli_server_process):
    proc, _ = cli_server_process
    children = [int(pid) for task in Path(f"/proc/{proc.pid}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    engine = [pid for pid in children if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()
              and "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(engine) == 1
    cpus = sorted(os.sched_getaffinity(0))
    assert os.sched_getaffinity(engine[0]) == {cpus[-1]}  # --torch-threads 1: one CPU, the last
    assert os.sched_getaffinity(proc.pid) == set(cpus[:-1])


async def test_a_repeated_prompt_comes_from_the_prompt_cache(client, cli_server):
    def cache() -> dict:
        return httpx.get(cli_server.removesuffix("/v1") + "/health").json()["batches"]["prompt_cache"]

    msgs = [UserMessage(content="Is the prompt cache on?")]
    first = await client.generate(msgs, params=GREEDY)
    hits = cache()["hits"]
    again = await client.generate(msgs, params=GREEDY)
    assert cache()["hits"] == hits + 1
    assert again.completion_ids == first.completion_ids
    assert max(abs(a - b) for a, b in zip(again.logprobs, first.logprobs)) < 1e-5


async def test_plain_chat_is_token_exact(client, tokenizer):
    turn = await client.generate([UserMessage(content="Hello!")], params=GREEDY)
    assert turn.message.content and not turn.message.tool_calls
    assert turn.finish_reason in ("stop", "length")
    assert turn.has_tokens and len(turn.logprobs) == len(turn.completion_ids)
    assert all(lp <= 0 for lp in turn.logprobs)
    assert tokenizer.decode(turn.completion_ids, skip_special_tokens=True).strip() == turn.message.content
    # the prompt is the chat template rendered by the checkpoint's own tokenizer
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True,
                                             tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert turn.prompt_ids == list(expected)
    assert turn.usage.prompt_tokens == len(turn.prompt_ids)
    assert turn.usage.completion_tokens == len(turn.completion_ids)


async def test_tool_call_comes_back_parsed(client):
    tools = [weather_tool()]
    msgs = [UserMessage(content="What is the weather in Paris?")]
    turn = await client.generate(msgs, tools=tools, params=GREEDY)
    assert turn.finish_reason == "tool_calls", turn.message
    (call,) = turn.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(call.parsed_arguments().get("city"), str)
    assert "<tool_call>" not in (turn.message.content or "")
    # the result goes back and the server accepts the whole exchange
    msgs += [turn.message, ToolMessage(tool_call_id=call.id, content="sunny")]
    follow = await client.generate(msgs, tools=tools, params=GREEDY)
    assert follow.has_tokens and follow.prompt_ids[:len(turn.prompt_ids)] == turn.prompt_ids


async def test_stream_matches_plain_text(client, cli_server):
    msgs = [UserMessage(content="Tell me a joke.")]
    plain = await client.generate(msgs, params=GREEDY)
    events = [e async for e in client.stream(msgs, params=GREEDY)]
    *deltas, done = events
    assert isinstance(done, TurnDone) and all(isinstance(d, TextDelta) for d in deltas)
    assert "".join(d.text for d in deltas) == plain.message.content == done.turn.message.content
    assert done.turn.completion_ids == plain.completion_ids
    with httpx.stream("POST", f"{cli_server}/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "tools": [weather_tool()], "temperature": 0, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    assert all("<tool_call>" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks)


def test_n_and_seed_reproducibility(cli_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Who are you?"}], "n": 3,
            "temperature": 1.0, "seed": 11, "max_tokens": 24, "return_token_ids": True, "logprobs": True}
    a = httpx.post(f"{cli_server}/chat/completions", json=body, timeout=60).json()
    b = httpx.post(f"{cli_server}/chat/completions", json=body, timeout=60).json()
    assert len(a["choices"]) == 3 and [c["index"] for c in a["choices"]] == [0, 1, 2]
    ids = lambda r: [c["token_ids"] for c in r["choices"]]  # noqa: E731
    assert ids(a) == ids(b), "the same seed must give the same samples"
    assert len({tuple(x) for x in ids(a)}) > 1, "the three choices should not all be equal"
    for c in a["choices"]:
        assert len(c["logprobs"]["content"]) == len(c["token_ids"])
    assert a["usage"]["completion_tokens"] == sum(len(x) for x in ids(a))


async def test_parallel_requests_all_succeed(client):
    prompts = ["Hello!", "What is 2 plus 3?", "Thanks!", "Goodbye.", "How are you?", "Hi", "Who are you?",
               "Tell me a joke."]
    reqs = [GenerateRequest([UserMessage(content=p)], params=GREEDY) for p in prompts]
    turns = await client.batch(reqs)
    assert len(turns) == 8 and all(t.has_tokens for t in turns)
    single = await client.generate([UserMessage(content=prompts[0])], params=GREEDY)
    assert turns[0].prompt_ids == single.prompt_ids


@pytest.mark.parametrize("body,status", [
    ({"model": "tiny"}, 400),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404),
])
def test_malformed_requests_against_the_cli_server(cli_server, body, status):
    r = httpx.post(f"{cli_server}/chat/completions", json=body, timeout=30)
    assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}

