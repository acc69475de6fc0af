"""Our graphs served by the LangGraph CLI's in-memory server (``langgraph dev``, from the repository's
``langgraph.json``), driven with the LangGraph SDK client: all six graphs listed with their run
context's schema, model and tools chosen per run through the run context (or the config), an
OpenAI-dict input read back in LangChain's form, messages streamed, an approval interrupt in
LangChain's HITL shape resumed with an edit, a graph with its own context settings run from JSON.
Skipped when ``langgraph-cli[inmem]`` is not installed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("langgraph", path=str(Path(sys.executable).parent) + os.pathsep
                                             + os.environ.get("PATH", "")) is None,
                                reason="langgraph-cli[inmem] is not installed (pip install 'langgraph-cli[inmem]')")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("langgraph_api", reason="langgraph-cli[inmem] is not installed")
    from closedloop.server.local import stop_process

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("lgdev") / "server.log"
    env = {**os.environ, "LANGGRAPH_CLI_NO_ANALYTICS": "1", "LANGSMITH_TRACING": "false", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    exe = shutil.which("langgraph", path=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""))
    log = log_path.open("w")
    proc = subprocess.Popen([exe, "dev", "--port", str(port), "--no-browser", "--no-reload", "--allow-blocking",
                             "--config", str(ROOT / "langgraph.json")], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    import httpx

    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"langgraph dev exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ok", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"langgraph dev not up after 120 s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    yield f"http://127.0.0.1:{port}", log_path
    stop_process(proc)
    log.close()


async def test_served_react_with_the_sdk(server, tiny_model_path):
    from langgraph_sdk import get_client

    url, log_path = server
    client = get_client(url=url)
    assistants = {a["graph_id"]: a for a in await client.assistants.search()}
    assert set(assistants) >= {"react", "clarifier", "factguard", "orchestrator", "kernel", "egg"}
    for graph_id in ("react", "clarifier", "factguard", "orchestrator", "kernel", "egg"):
        schemas = await client.assistants.get_schemas(assistants[graph_id]["assistant_id"])
        properties = schemas["context_schema"]["properties"]
        assert {"model", "tools", "params", "approve"} <= set(properties), graph_id
    assert "threshold" in (await client.assistants.get_schemas(assistants["clarifier"]["assistant_id"]))[
        "context_schema"]["properties"]
    config = {"configurable": {"model": f"hf:{tiny_model_path}", "tools": "arithmetic", "params": {"temperature": 0, "max_tokens": 48}}}

    thread = await client.threads.create()
    out = await client.runs.wait(thread["thread_id"], "react", config=config,
                                 input={"messages": [{"role": "user", "content": "What is 3 plus 4?"}]})
    messages = out["messages"]
    assert messages[0]["type"] == "human" and messages[0]["content"] == "What is 3 plus 4?"  # LangChain's form
    assert messages[-1]["type"] == "ai" and len(out["turns"]) >= 1
    assert out["turns"][0]["completion_ids"]  # the token-exact record travels with the state

    # streamed: the model's tokens as message chunks
    thread2 = await client.threads.create()
    kinds = []
    async for part in client.runs.stream(thread2["thread_id"], "react", config=config, stream_mode="messages-tuple",
                                         input={"messages": [{"role": "user", "content": "Hello!"}]}):
        if part.event == "messages":
            kinds.append(part.data[0]["type"])
    assert "AIMessageChunk" in kinds or "ai" in kinds

    # an approval pauses in LangChain's HITL shape and resumes with an edit
    assert any(m.get("tool_calls") for m in messages), "the tiny model answers this with a tool call"
    assert out["turns"][0]["completion_ids"] == messages[1]["response_metadata"]["closedloop_turn"]["completion_ids"]
    thread3 = await client.threads.create()
    paused = await client.runs.wait(thread3["thread_id"], "react", config={
        "configurable": {**config["configurable"], "approve": True}},
        input={"messages": [{"role": "user", "content": "What is 3 plus 4?"}]})
    state = await client.threads.get_state(thread3["thread_id"])
    request = state["tasks"][0]["interrupts"][0]["value"]
    assert request["review_configs"][0]["allowed_decisions"] == ["approve", "edit", "reject"]
    name = request["action_requests"][0]["name"]
    decisions = [{"type": "edit", "edited_action": {"name": "add", "args": {"a": 40, "b": 2}}}] + \
        [{"type": "approve"}] * (len(request["action_requests"]) - 1)
    done = await client.runs.wait(thread3["thread_id"], "react", config={
        "configurable": {**config["configurable"], "approve": True}}, command={"resume": {"decisions": decisions}})
    assert name and "42.0" in done["tool_records"][0]["content"]
    assert "__interrupt__" in paused or state["next"] == ["tools"]
    assert "will be blocked" not in log_path.read_text()  # our types revive in the server's checkpointer

    # a graph with settings of its own, chosen through the run context as JSON
    thread4 = await client.threads.create()
    clarified = await client.runs.wait(thread4["thread_id"], "clarifier", context={
        "model": f"hf:{tiny_model_path}", "threshold": 0.0, "params": {"temperature": 0, "max_tokens": 24}},
        input={"messages": [{"role": "user", "content": "I want to return something."}]})
    assert clarified["scratch"]["decision"] in {"ask", "proceed"} and clarified["turns"], clarified
    assert clarified["turns"][0]["purpose"] == "propose_goals"  # the policy proposed the candidate goals
