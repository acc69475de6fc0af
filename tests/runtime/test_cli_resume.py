"""``closedloop run --thread T`` resumes a killed run exactly where it stopped (issue 9, point 8).

The model is a stub OpenAI-compatible HTTP server in this process (real sockets, the real
``openai:`` client): it can hold a request open so the CLI is SIGKILLed mid model step, and it
records every request, so the test sees what the model was asked on resume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from closedloop.store import RunStore


class Stub:
    def __init__(self, mode: str) -> None:
        self.mode = mode  # "answer": reply directly; "tool": call add(3, 4) first
        self.requests: list[list[dict]] = []
        self.release = threading.Event()
        self.release.set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body["messages"])
                server.release.wait(60)
                last = body["messages"][-1]
                message = {"role": "assistant", "content": "The answer is 7."}
                if server.mode == "tool" and last["role"] == "user":
                    message = {"role": "assistant", "content": None, "tool_calls": [{
                        "id": f"call_{len(server.requests)}", "type": "function",
                        "function": {"name": "add", "arguments": json.dumps({"a": 3, "b": 4})}}]}
                out = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "stub",
                                  "choices": [{"index": 0, "message": message, "logprobs": None,
                                               "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()


@pytest.fixture
def stub_factory():
    made = []

    def make(mode):
        made.append(Stub(mode))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _cmd(stub: Stub, tmp_path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "closedloop", "run", "react", "--model", f"openai:stub@{stub.url}",
            "--input", "What is 3 plus 4?", "--checkpoint", str(tmp_path / "ck.sqlite"), "--thread", "T",
            "--store", str(tmp_path / "runs.duckdb"), "--no-stream", *extra]


def _env(tmp_path):
    return {**os.environ, "CLOSEDLOOP_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def _wait_for(pred, timeout=90.0, what=""):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _runs(tmp_path):
    store = RunStore(tmp_path / "runs.duckdb")
    try:
        return [store.get_run(r.id) for r in store.list_runs()]
    finally:
        store.close()


def test_killed_during_a_model_step_resumes_without_duplicating(stub_factory, tmp_path):
    stub = stub_factory("answer")
    stub.release.clear()  # the first model call hangs
    proc = subprocess.Popen(_cmd(stub, tmp_path), env=_env(tmp_path), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: stub.requests or proc.poll() is not None, what="the model call")
        assert proc.poll() is None, proc.stdout.read().decode()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        stub.release.set()
    done = subprocess.run(_cmd(stub, tmp_path), env=_env(tmp_path), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming thread T at model" in done.stdout and "The answer is 7." in done.stdout
    users = [m for m in stub.requests[-1] if m["role"] == "user"]
    assert len(stub.requests) == 2 and len(users) == 1  # the step re-ran; the user message is there once
    statuses = sorted(r.status for r in _runs(tmp_path))
    assert "completed" in statuses and statuses.count("completed") == 1


def test_pending_approval_waits_survives_a_kill_and_is_asked_again(stub_factory, tmp_path):
    stub = stub_factory("tool")
    # 1. nobody at the terminal: the run is recorded waiting, not completed
    first = subprocess.run(_cmd(stub, tmp_path, "--approve"), env=_env(tmp_path), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    (run,) = _runs(tmp_path)
    assert run.status == "waiting" and run.outcome["pending"][0]["action_requests"][0]["name"] == "add"
    # 2. asked again, then killed while the prompt waits
    proc = subprocess.Popen(_cmd(stub, tmp_path, "--approve"), env=_env(tmp_path), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = bytearray()
    threading.Thread(target=lambda: [out.extend(c) for c in iter(lambda: proc.stdout.read(1), b"")],
                     daemon=True).start()
    _wait_for(lambda: b"run add" in out or proc.poll() is not None, what="the approval prompt")
    assert proc.poll() is None, out.decode()
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert len(stub.requests) == 1  # the model was not asked again: the approval was pending
    # 3. resumed, the arguments edited at the prompt: the tool runs once, the model answers
    done = subprocess.run(_cmd(stub, tmp_path, "--approve"), env=_env(tmp_path), input='e\n{"a": 40, "b": 2}\n',
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "approval pending" in done.stdout and "run add" in done.stdout and "The answer is 7." in done.stdout
    final = stub.requests[-1]
    assert [m["role"] for m in final if m["role"] != "system"] == ["user", "assistant", "tool"]
    assert final[-1]["content"].endswith("42.0") and "edited" in final[-1]["content"]
    assert sorted(r.status for r in _runs(tmp_path)).count("completed") == 1
