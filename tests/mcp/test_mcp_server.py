"""``closedloop mcp serve`` as a real subprocess, driven by the official SDK's own clients.

Each transport (stdio, streamable HTTP) gets one server process per module; one client session
runs every scenario against it and the tests below check what came back. Starting a server costs
seconds on a loaded 2-core machine, a scenario milliseconds.

The server holds an ``OPENAI_API_KEY`` and allows one endpoint (``--allow-model``) of a real HTTP
listener in this process; a model argument naming any other URL must never reach it (issue 26: a
tool argument sent the server's key to any URL). ``closedloop tool call`` is checked the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

pytest.importorskip("mcp")

from closedloop import plugins  # noqa: E402
from closedloop.mcp_server import PathOutsideWorkdir, check_paths, unreadable_line_error  # noqa: E402
from closedloop.server.local import stop_process  # noqa: E402

MODULES = "arithmetic,mesh_certificate,culture_mt"
FACES = [[0, 1, 2], [1, 3, 2]]
KEY = "sk-planted0123456789abcdefghijklmnop"  # the server's key: it may only reach the allowed endpoint
DATA = Path(__file__).resolve().parents[1] / "tools" / "data"
VERDICT = '{"accuracy": 4, "adaptability": 3}'


class Listener:
    """A real HTTP endpoint recording every request (and answering like an OpenAI-compatible server)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                seen.append({"path": self.path, "authorization": self.headers.get("authorization"), "body": body})
                model = json.loads(body or b"{}").get("model", "m")
                reply = json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": model,
                                    "choices": [{"index": 0, "finish_reason": "stop",
                                                 "message": {"role": "assistant", "content": VERDICT}}],
                                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_POST

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def listener() -> Iterator[Listener]:
    served = Listener()
    yield served
    served.close()


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "OPENAI_API_KEY": KEY, "CLOSEDLOOP_HOME": str(tmp / "home"),
            "CLOSEDLOOP_ARTIFACTS": str(tmp / "elsewhere")}  # outside the workdir: the server must override it


def _layout(tmp: Path) -> tuple[Path, Path]:
    """A workdir holding faces.npy, CULTURE-MT notes and hypotheses (and symlinks that escape it)
    next to a directory outside it, which holds a model-like directory."""
    work, outside = tmp / "work", tmp / "outside"
    work.mkdir()
    outside.mkdir()
    np.save(work / "faces.npy", np.array(FACES))
    np.save(outside / "faces.npy", np.array(FACES))
    (work / "escape.npy").symlink_to(outside / "faces.npy")
    shutil.copy(DATA / "culture_mt_sample.jsonl", work / "notes.jsonl")
    shutil.copy(DATA / "culture_mt_sample_literal.jsonl", work / "hyps.jsonl")
    (outside / "model").mkdir()
    (outside / "model" / "config.json").write_text("{}")
    (work / "model-link").symlink_to(outside / "model")
    return work, outside


def _text(result: Any) -> str:
    return "".join(c.text for c in result.content if getattr(c, "type", "") == "text")


async def _scenarios(session: Any, outside: Path, listener: Listener) -> dict[str, Any]:
    init = await session.initialize()
    listed = await session.list_tools()
    seen: dict[str, Any] = {"schemas": {t.name: t.input_schema for t in listed.tools},
                            "descriptions": {t.name: t.description for t in listed.tools},
                            "instructions": init.instructions or "", "arrived": {}}

    async def call(key: str, name: str, arguments: dict[str, Any]) -> None:
        before = len(listener.requests)
        try:
            r = await session.call_tool(name, arguments)
        except Exception as e:  # noqa: BLE001 - a protocol error: what these tests say must not happen
            seen[key] = {"protocol_error": f"{type(e).__name__}: {e}"}
            return
        # a refused call never ran, so nothing can arrive later: counting now is exact
        seen[key] = {"is_error": bool(r.is_error), "text": _text(r)}
        seen["arrived"][key] = listener.requests[before:]

    await call("add", "add", {"a": 2, "b": 3.5})
    await call("add_invalid", "add", {"a": "two", "b": 1})
    await call("add_extra", "add", {"a": 1, "b": 2, "c": 3})
    await call("unknown", "no_such_tool", {})
    await call("missing_file", "mesh_incidence", {"faces": "missing.npy"})
    await call("inline", "mesh_incidence", {"faces": FACES})
    await call("path_inside", "mesh_incidence", {"faces": "faces.npy"})
    await call("path_dotdot", "mesh_incidence", {"faces": "../outside/faces.npy"})
    await call("path_absolute", "mesh_incidence", {"faces": str(outside / "faces.npy")})
    await call("path_symlink", "mesh_incidence", {"faces": "escape.npy"})
    if not seen["path_inside"]["is_error"]:
        report = json.loads(seen["path_inside"]["text"])
        seen["returned_paths"] = [report["d0"]["path"], report["d1"]["path"]]
        await call("roundtrip", "compatibility_certificate", {"d0": report["d0"]["path"], "d1": report["d1"]["path"]})
    await call("path_nul", "mesh_incidence", {"faces": "fa\x00ces.npy"})
    await call("path_long", "mesh_incidence", {"faces": "a" * 5000 + ".npy"})
    await call("path_long_name", "mesh_incidence", {"faces": "x/" + "a" * 300 + ".npy"})
    judge = {"notes_path": "notes.jsonl", "hypotheses_path": "hyps.jsonl", "max_notes": 1}
    for key, model in [("judge_caller_url", f"openai:m@{listener.url}"),
                       ("judge_other_model_at_allowed_url", f"openai:other@{listener.url}"),
                       ("judge_default_endpoint", "openai:gpt-4o"),
                       ("judge_hub_model", "hf:Qwen/Qwen2-0.5B"),
                       ("judge_model_outside", f"hf:{outside / 'model'}"),
                       ("judge_model_dotdot", "hf:../outside/model"),
                       ("judge_model_link", "hf:model-link"),
                       ("judge_allowed", f"openai:allowed@{listener.url}")]:
        await call(key, "culture_mt_judge", {**judge, "judge_model": model})
    return seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_args(work: Path, listener: Listener) -> list[str]:
    return ["-m", "closedloop", "mcp", "serve", "--tools", MODULES, "--workdir", str(work),
            "--allow-model", f"openai:allowed@{listener.url}"]


def _run_stdio(work: Path, outside: Path, env: dict[str, str], listener: Listener) -> dict[str, Any]:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    # cwd is NOT the workdir: relative paths must resolve against --workdir, not the process's cwd.
    params = StdioServerParameters(command=sys.executable, cwd=str(outside), env=env, args=_serve_args(work, listener))

    async def go() -> dict[str, Any]:
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                return await _scenarios(session, outside, listener)

    return asyncio.run(go())


def _run_http(work: Path, outside: Path, env: dict[str, str], log: Path, listener: Listener,
              wait_listening: Any) -> dict[str, Any]:
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    port = _free_port()
    cmd = [sys.executable, *_serve_args(work, listener), "--transport", "http", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=outside, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_listening(proc, port, log)

        async def go() -> dict[str, Any]:
            async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read, write):
                async with ClientSession(read, write) as session:
                    return await _scenarios(session, outside, listener)

        return asyncio.run(go())
    finally:
        stop_process(proc)


@pytest.fixture(scope="module", params=["stdio", "http"])
def served(request, tmp_path_factory, listener, wait_listening) -> tuple[dict[str, Any], Path, Path]:
    tmp = tmp_path_factory.mktemp(f"mcp-{request.param}")
    work, outside = _layout(tmp)
    env = _env(tmp)
    if request.param == "stdio":
        return _run_stdio(work, outside, env, listener), work, outside
    return _run_http(work, outside, env, tmp / "server.log", listener, wait_listening), work, outside


def test_list_tools_advertises_our_own_schemas(served):
    seen, _, _ = served
    registry = plugins.tool_registry(MODULES.split(","))
    assert seen["schemas"] == {t.name: t.parameters for t in registry}
    assert seen["descriptions"] == {t.name: t.description for t in registry}


def test_a_valid_call_returns_the_tool_result(served):
    seen, _, _ = served
    assert seen["add"] == {"is_error": False, "text": "5.5"}


def test_invalid_arguments_are_a_tool_error_with_the_validation_message(served):
    seen, _, _ = served
    assert seen["add_invalid"]["is_error"]
    assert "invalid arguments for add" in seen["add_invalid"]["text"] and "a:" in seen["add_invalid"]["text"]
    assert seen["add_extra"]["is_error"] and "c:" in seen["add_extra"]["text"]  # extra="forbid", as in graphs
    assert seen["unknown"]["is_error"] and "unknown tool 'no_such_tool'" in seen["unknown"]["text"]


def test_the_tools_own_failure_is_a_tool_error_too(served):
    seen, _, _ = served
    assert seen["missing_file"]["is_error"]
    assert "raised ArtifactError" in seen["missing_file"]["text"] and "file not found" in seen["missing_file"]["text"]


def test_array_arguments_work_inline_and_as_paths_inside_the_workdir(served):
    seen, work, _ = served
    for key in ("inline", "path_inside"):
        assert not seen[key]["is_error"], seen[key]["text"]
        report = json.loads(seen[key]["text"])
        assert (report["n_vertices"], report["n_edges"], report["n_faces"]) == (4, 5, 2)
    # outputs land inside the workdir (CLOSEDLOOP_ARTIFACTS pointed outside is overridden) and can be passed back
    assert all(Path(p).resolve().is_relative_to(work.resolve()) for p in seen["returned_paths"])
    assert not seen["roundtrip"]["is_error"], seen["roundtrip"]["text"]


@pytest.mark.parametrize("key", ["path_dotdot", "path_absolute", "path_symlink", "judge_model_outside",
                                 "judge_model_dotdot", "judge_model_link"])
def test_paths_resolving_outside_the_workdir_are_refused_without_revealing_the_layout(served, key):
    seen, work, outside = served
    text = seen[key]["text"]
    assert seen[key]["is_error"] and "outside the server's working directory" in text, text
    assert str(work.resolve()) not in text and str(work) not in text  # the server's own directory
    if key in ("path_symlink", "judge_model_link", "path_dotdot", "judge_model_dotdot"):
        assert str(outside.resolve()) not in text  # where a link or ../ leads is not the client's to learn
    assert str(work) not in seen["instructions"] and "working directory" in seen["instructions"]


@pytest.mark.parametrize("key", ["path_nul", "path_long", "path_long_name"])
def test_unusable_paths_are_tool_errors_not_protocol_errors(served, key):
    seen, _, _ = served
    assert "protocol_error" not in seen[key], seen[key]
    assert seen[key]["is_error"] and "outside the working root" in seen[key]["text"] or \
        "not a usable path" in seen[key]["text"], seen[key]["text"]


@pytest.mark.parametrize("key", ["judge_caller_url", "judge_other_model_at_allowed_url", "judge_default_endpoint",
                                 "judge_hub_model"])
def test_a_model_argument_cannot_send_the_servers_key_to_a_url_of_the_callers_choice(served, key):
    seen, _, _ = served
    assert seen[key]["is_error"] and "operator allows" in seen[key]["text"], seen[key]["text"]
    assert "invalid arguments for culture_mt_judge" in seen[key]["text"]
    assert seen["arrived"][key] == []  # nothing reached the listener: the tool never ran
    assert KEY not in seen[key]["text"]


def test_the_endpoint_the_operator_allowed_is_reached_with_the_configured_key(served):
    seen, _, _ = served  # the positive control: the listener and --allow-model really work
    allowed, arrived = seen["judge_allowed"], seen["arrived"]["judge_allowed"]
    assert not allowed["is_error"], allowed["text"]
    assert [r["authorization"] for r in arrived] == [f"Bearer {KEY}"]
    assert json.loads(arrived[0]["body"])["model"] == "allowed"
    assert json.loads(allowed["text"])["judged"] == 1


def test_the_cli_never_sends_the_key_to_a_url_of_the_callers_choice(listener, tmp_path):
    shutil.copy(DATA / "culture_mt_sample.jsonl", tmp_path / "notes.jsonl")
    shutil.copy(DATA / "culture_mt_sample_literal.jsonl", tmp_path / "hyps.jsonl")
    args = json.dumps({"notes_path": "notes.jsonl", "hypotheses_path": "hyps.jsonl", "max_notes": 1,
                       "judge_model": f"openai:m@{listener.url}"})

    def call(*extra: str) -> tuple[subprocess.CompletedProcess, list[dict[str, Any]]]:
        before = len(listener.requests)
        proc = subprocess.run([sys.executable, "-m", "closedloop", "tool", "call", "culture_mt_judge", "--tools",
                               "culture_mt", "--no-store", "--json", "--args", args, *extra], cwd=tmp_path,
                              env=_env(tmp_path), capture_output=True, text=True)
        return proc, listener.requests[before:]

    refused, arrived = call()
    assert refused.returncode == 2 and arrived == [], refused.stderr
    out = json.loads(refused.stdout)
    assert out["error_kind"] == "invalid_arguments" and "operator allows" in out["error"] and KEY not in refused.stdout
    allowed, arrived = call("--allow-model", f"openai:m@{listener.url}")  # the operator's choice, not the caller's
    assert allowed.returncode == 0, allowed.stderr
    assert [r["authorization"] for r in arrived] == [f"Bearer {KEY}"]


def test_stdio_answers_every_line_it_cannot_read(tmp_path):
    """The SDK's stdio transport drops such lines silently, so the client waits forever."""
    lines = ["garbage", '{"jsonrpc": "2.0", "id": 7, "method": 5}',
             '{"jsonrpc": "2.0", "id": "x", "method": "tools/call", "params": ', "[1, 2]",
             json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                         "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                    "clientInfo": {"name": "raw", "version": "1"}}})]
    proc = subprocess.Popen([sys.executable, "-m", "closedloop", "mcp", "serve", "--tools", "arithmetic",
                             "--workdir", str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=_env(tmp_path))
    answers: list[dict[str, Any]] = []

    def talk() -> None:  # every answer, up to the one to initialize (sent last, so answered last)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n".join(lines) + "\n")
        proc.stdin.flush()
        for line in proc.stdout:
            answers.append(json.loads(line))
            if answers[-1].get("id") == 1:
                break

    talker = threading.Thread(target=talk, daemon=True)
    talker.start()
    talker.join(900)  # a guard against a hung run only: the server answers as soon as it has started
    stop_process(proc)
    errors = [(a["id"], a["error"]["code"]) for a in answers if "error" in a]
    assert errors == [(None, -32700), (7, -32600), ("x", -32700), (None, -32600)], answers
    assert answers[-1]["id"] == 1 and "result" in answers[-1]


def test_unreadable_line_errors_carry_the_id_when_one_can_be_read():
    import mcp_types as types

    def answer(line: str) -> tuple[Any, int]:
        try:
            types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        except Exception as e:  # noqa: BLE001 - what the SDK's transport hands the server
            error = unreadable_line_error(e)
            return error.id, error.error.code
        raise AssertionError(f"{line!r} is a valid message")

    assert answer('{"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": ') == (3, -32700)
    assert answer('{"jsonrpc": "2.0", "id": true, "method": 1}') == (None, -32600)  # a bool is no id
    assert answer('{"jsonrpc": "1.0", "id": "a", "method": "ping"}') == ("a", -32600)
    assert answer("\x00\xff") == (None, -32700)


def test_check_paths_leaves_non_paths_alone_and_resolves_relative_ones(tmp_path):
    (tmp_path / "table").write_text("x")
    args = {"kernel": "rbf", "features": "mercer:5", "x": [[1.0, 2.0]], "data": "d.npz", "sub": "a/b.npy",
            "ratio": "1/2", "url": "https://example.org/a.json", "file": "./table"}
    out = check_paths(args, tmp_path)
    for unchanged in ("kernel", "features", "x", "ratio", "url"):
        assert out[unchanged] == args[unchanged]
    root = tmp_path.resolve()
    assert (out["data"], out["sub"], out["file"]) == (str(root / "d.npz"), str(root / "a/b.npy"), str(root / "table"))
    with pytest.raises(PathOutsideWorkdir, match=r"items\[1\]"):
        check_paths({"items": ["ok.npy", "~/../../etc/passwd"]}, tmp_path)
    (tmp_path / "ckpt").mkdir()
    out = check_paths({"model": "hf:ckpt", "hub": "hf:Qwen/Qwen2-0.5B", "url": "openai:m@http://h/v1"}, tmp_path)
    assert out == {"model": f"hf:{root / 'ckpt'}", "hub": "hf:Qwen/Qwen2-0.5B", "url": "openai:m@http://h/v1"}
    with pytest.raises(PathOutsideWorkdir, match="^judge: path '../x' is outside"):
        check_paths({"judge": "vllm:../x"}, tmp_path)
    deep: Any = "../../etc/x.npy"
    for _ in range(5000):  # far deeper than Python's recursion limit: Tool.run refuses it, not a crash here
        deep = [deep]
    walked, depth = check_paths({"deep": deep}, tmp_path)["deep"], 0
    while isinstance(walked, list):
        walked, depth = walked[0], depth + 1
    assert (depth, walked) == (5000, "../../etc/x.npy")  # left as it was, for Tool.run's depth limit
