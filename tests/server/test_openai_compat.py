"""The ``openai:`` backend against OpenAI-compatible servers people run, as real processes.

Servers checked here:

* ``transformers`` - ``transformers serve`` (the ``serving`` extra) on the tiny model, a separate
  process started once per session. It refuses fields it does not know with a 422
  (``return_token_ids``) and ignores others (``logprobs``, ``tool_choice``), so its turns carry
  no token ids and say why in ``Turn.unavailable``.
* ``closedloop`` - our own server (``closedloop.server``) over the tiny model: token-exact.
* ``env`` - any server a user points at: ``CLOSEDLOOP_OPENAI_COMPAT_URL=http://host:port/v1``
  (model from ``CLOSEDLOOP_OPENAI_COMPAT_MODEL``, else the first of ``/v1/models``; key from
  ``OPENAI_API_KEY``). The same tests run; checks that hold only for the tiny model (greedy
  determinism across streaming, a tool round trip in ``react``) are limited to the servers we start.

    CLOSEDLOOP_OPENAI_COMPAT_URL=http://127.0.0.1:8000/v1 python -m pytest -q tests/server/test_openai_compat.py -k env
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from closedloop.cli import main
from closedloop.evals.tau.simulation import TerminationReason
from closedloop.messages import MissingTokensError, ToolMessage, Trajectory, Turn, UserMessage
from closedloop.models import SamplingParams, TextDelta, TurnDone
from closedloop.models.openai_client import OpenAIClient
from closedloop.models.server_features import forget_server_features
from closedloop.server.local import stop_process
from closedloop.store import RunStore

from .conftest import free_port, serve_in_thread

pytestmark = pytest.mark.slow
ENV_URL, ENV_MODEL = "CLOSEDLOOP_OPENAI_COMPAT_URL", "CLOSEDLOOP_OPENAI_COMPAT_MODEL"
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, seed=7)
QUESTION = "What is 3 plus 4?"


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    model: str
    ours: bool  # started by these tests on the tiny model (deterministic on CPU, known behaviour)

    @property
    def spec(self) -> str:
        return f"openai:{self.model}@{self.url}"


@pytest.fixture(autouse=True)
def _fresh_server_memory() -> Iterator[None]:
    """Each test learns its server's refusals itself (ports of finished servers may be reused)."""
    forget_server_features()
    yield
    forget_server_features()


# --------------------------------------------------------------------------- servers


def _wait_ready(url: str, proc: subprocess.Popen | None, log: Path | None, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"no answer from {url} within {timeout_s} s:\n{log.read_text()[-3000:] if log else ''}")


@pytest.fixture(scope="session")
def transformers_server(tiny_model_path, tmp_path_factory) -> Iterator[Server]:
    """``transformers serve <tiny> --device cpu`` on a free port, once per session."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        pytest.skip("transformers serve needs its serving extra (fastapi, uvicorn, openai): pip install -e .[test]")
    port = free_port()
    log = tmp_path_factory.mktemp("transformers-serve") / "serve.log"
    cmd = [sys.executable, "-c", "from transformers.cli.transformers import main; main()", "serve",
           str(tiny_model_path), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with log.open("w") as out:  # a file, not a pipe: an unread pipe would fill up and stall the server
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/health", proc, log)
        yield Server("transformers", f"http://127.0.0.1:{port}/v1", str(tiny_model_path), ours=True)
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def closedloop_server(tiny_model_path) -> Iterator[Server]:
    from closedloop.models.hf import HFClient

    with serve_in_thread(HFClient.from_pretrained(tiny_model_path), "tiny") as url:
        yield Server("closedloop", url, "tiny", ours=True)


@pytest.fixture(scope="session")
def env_server() -> Server:
    url = os.environ.get(ENV_URL)
    if not url:
        pytest.skip(f"set {ENV_URL}=http://host:port/v1 to check your own server")
    url = url.rstrip("/")
    model = os.environ.get(ENV_MODEL)
    if not model:
        key = os.environ.get("OPENAI_API_KEY", "EMPTY")
        models = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()["data"]
        model = models[0]["id"]
    return Server("env", url, model, ours=False)


@pytest.fixture(params=["transformers", "closedloop", "env"])
def server(request) -> Server:
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture
async def client(server: Server):
    c = OpenAIClient(server.model, base_url=server.url, timeout_s=300)
    yield c
    await c.aclose()


def arithmetic_schemas() -> list[dict]:
    from closedloop.tools.arithmetic import TOOLS

    return [t.schema for t in TOOLS]


def check_tokens(server: Server, turn: Turn) -> None:
    """What each server gives: ours token ids and logprobs; transformers neither, with reasons
    that a trainer's refusal repeats; any other server one or the other, never silently."""
    if turn.has_tokens:
        assert "token_ids" not in turn.unavailable
        if turn.logprobs is not None:
            assert len(turn.logprobs) == len(turn.completion_ids)
            assert turn.logprob_spec.mode == "server" and turn.logprob_spec.backend == server.spec
            assert turn.logprob_spec.temperature == 0.0
    else:
        reason = turn.unavailable["token_ids"]
        with pytest.raises(MissingTokensError, match="no token ids") as err:
            Trajectory(turns=[turn]).token_view()
        assert reason in str(err.value)
    if turn.logprobs is None:
        assert turn.unavailable["logprobs"] and turn.logprob_spec is None
    if server.name == "closedloop":
        assert turn.has_tokens and turn.logprobs is not None and turn.unavailable == {}
    if server.name == "transformers":
        assert not turn.has_tokens and turn.logprobs is None
        assert "rejected 'return_token_ids'" in turn.unavailable["token_ids"]
        assert "Unexpected fields" in turn.unavailable["token_ids"]  # the server's own words
        assert "ignores 'logprobs'" in turn.unavailable["logprobs"]


# --------------------------------------------------------------------------- chat, tools, streaming


async def test_plain_chat(server, client):
    turn = await client.generate([UserMessage(content="Hello there!")], params=GREEDY)
    assert turn.message.content or turn.message.tool_calls
    assert turn.finish_reason in ("stop", "length", "tool_calls")
    assert turn.usage.completion_tokens > 0 and turn.usage.prompt_tokens > 0
    check_tokens(server, turn)
    again = await client.generate([UserMessage(content="Hello there!")], params=GREEDY)
    check_tokens(server, again)  # the second request is asked correctly at once
    assert again.unavailable == turn.unavailable
    if server.name == "transformers":
        assert set(client.features.rejected) == {"return_token_ids"} and client.token_ids is False
    if server.name == "closedloop":
        assert client.features.rejected == {} and client.token_ids is True


async def test_tool_call_round_trip(server, client):
    tools = arithmetic_schemas()
    names = {t["function"]["name"] for t in tools}
    msgs = [UserMessage(content=QUESTION)]
    turn = await client.generate(msgs, tools=tools, params=GREEDY, tool_choice="required")
    assert turn.finish_reason == "tool_calls" and turn.message.tool_calls, turn.message
    for call in turn.message.tool_calls:
        assert call.name in names and set(call.parsed_arguments()) <= {"a", "b"}
    check_tokens(server, turn)
    msgs += [turn.message] + [ToolMessage(tool_call_id=c.id, content="7.0", name=c.name)
                              for c in turn.message.tool_calls]
    follow = await client.generate(msgs, tools=tools, params=GREEDY)
    assert follow.message.content or follow.message.tool_calls
    check_tokens(server, follow)
    if server.name == "closedloop":  # the second prompt extends the first, token for token
        assert follow.prompt_ids[:len(turn.prompt_ids)] == turn.prompt_ids


@pytest.mark.parametrize("with_tools", [False, True], ids=["text", "tools"])
async def test_streaming(server, client, with_tools):
    tools = arithmetic_schemas() if with_tools else None
    msgs = [UserMessage(content=QUESTION if with_tools else "Tell me a joke.")]
    events = [e async for e in client.stream(msgs, tools=tools, params=GREEDY)]
    *deltas, done = events
    assert isinstance(done, TurnDone) and all(isinstance(d, TextDelta) for d in deltas)
    turn = done.turn
    assert "".join(d.text for d in deltas) == (turn.message.content or "")
    assert turn.finish_reason in ("stop", "length", "tool_calls") and turn.usage.completion_tokens > 0
    assert "usage" not in turn.unavailable
    check_tokens(server, turn)
    if server.ours:  # greedy on CPU: streaming gives exactly what a plain request gives
        plain = await client.generate(msgs, tools=tools, params=GREEDY)
        assert turn.message.content == plain.message.content
        assert [(c.name, c.parsed_arguments()) for c in turn.message.tool_calls or []] == \
            [(c.name, c.parsed_arguments()) for c in plain.message.tool_calls or []]
        assert turn.completion_ids == plain.completion_ids
        if with_tools:
            assert turn.message.tool_calls and turn.finish_reason == "tool_calls"


# --------------------------------------------------------------------------- the CLI, end to end


def test_closedloop_run_react(server, tmp_path):
    db = tmp_path / "runs.duckdb"
    rc = main(["run", "react", "--model", server.spec, "--tools", "arithmetic", "--input", QUESTION,
               "--store", str(db), "--max-turns", "4", "--max-tokens", "48", "--temperature", "0"])
    assert rc == 0
    [summary] = RunStore(db).list_runs()
    run = RunStore(db).get_run(summary.id)
    assert run.status == "completed" and run.model_spec == server.spec and run.turns
    for turn in run.turns:
        check_tokens(server, turn)
    if server.ours:  # the tiny model calls add, reads the result, answers: a multi-turn run
        assert run.turns[0].message.tool_calls and len(run.turns) >= 2
        assert any(m.role == "tool" for m in run.messages)
    trajectory = Trajectory(turns=run.turns)
    if server.name == "closedloop":
        [view] = trajectory.token_view(missing_logprobs="refuse")
        assert sum(view.loss_mask) == sum(len(t.completion_ids) for t in run.turns)
    if server.name == "transformers":
        with pytest.raises(MissingTokensError, match="rejected 'return_token_ids'"):
            trajectory.token_view()


def _tau_support():
    """The τ tests' small retail data root (their package is not importable from here)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "evals" / "tau" / "_support.py"
    spec = importlib.util.spec_from_file_location("_tau_support_for_compat", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_closedloop_eval_tau_react(server, tmp_path):
    tau = _tau_support()
    root = tau.write_root(tmp_path / "data", tau.mini_db(), tau.mini_tasks(), {"train": ["cancel", "noop"]})
    db, out = tmp_path / "eval.duckdb", tmp_path / "results.json"
    rc = main(["eval", "tau", "--domain", "retail", "--split", "train", "--task-ids", "cancel", "--data-dir", str(root),
               "--agent", "react", "--model", server.spec, "--user-model", "scenario", "--max-steps", "8",
               "--max-tokens", "48", "--temperature", "0", "--store", str(db), "--export", str(out),
               "--concurrency", "1"])
    assert rc == 0
    [sim] = json.loads(out.read_text())["simulations"]
    assert sim["termination_reason"] != TerminationReason.INFRASTRUCTURE_ERROR.value, sim.get("error")
    assert any(m["role"] == "assistant" for m in sim["messages"])
    store = RunStore(db)
    [parent] = store.list_runs(kind="eval")
    assert parent.status == "completed"
    [episode] = store.list_runs(parent_id=parent.id)
    turns = store.get_run(episode.id).turns
    assert turns
    for turn in turns:
        check_tokens(server, turn)
