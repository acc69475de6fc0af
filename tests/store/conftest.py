"""Fixtures for the run-store contract suite.

Like langgraph's checkpoint conformance suite, the behavioural tests take a ``store`` fixture and
run against every backend: a DuckDB file (the real thing) and DuckDB ``:memory:``. Tests that need
several processes use ``store_path`` directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from closedloop.messages import AssistantMessage, ToolCall, Turn, Usage
from closedloop.store import RunStore

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "runs.duckdb"


@pytest.fixture(params=["file", "memory"])
def store(request, store_path: Path):
    s = RunStore(store_path if request.param == "file" else ":memory:")
    yield s
    s.close()


def make_turn(text: str = "ok", *, tool: str | None = None, args: dict | None = None, model: str = "tiny-test",
              n_prompt: int = 4, n_completion: int = 3, offset: int = 0, cost: float | None = None) -> Turn:
    calls = [ToolCall.make(tool, args or {})] if tool else None
    prompt = list(range(offset, offset + n_prompt))
    completion = list(range(1000 + offset, 1000 + offset + n_completion))
    return Turn(message=AssistantMessage(content=text, tool_calls=calls), model=model, prompt_ids=prompt,
                completion_ids=completion, logprobs=[-0.5 - 0.1 * i for i in range(n_completion)],
                completion_text=text, finish_reason="tool_calls" if tool else "stop",
                usage=Usage(prompt_tokens=n_prompt, completion_tokens=n_completion, cost_usd=cost), latency_s=0.25)


def run_python(code: str, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a child Python process with the repo importable; returns the completed process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=full_env)


# A writer that opens a run, logs a turn, then SIGKILLs itself: no finally, no atexit, no finish_run.
KILLED_WRITER_IMPORT = """
import os, signal, sys
from closedloop.messages import AssistantMessage, Turn, UserMessage, Usage
from closedloop.store import RunStore

store = RunStore(sys.argv[1])
run_id = store.start_run(kind="eval", graph="react")
store.log_messages(run_id, [UserMessage(content="hello")])
store.log_turn(run_id, Turn(message=AssistantMessage(content="partial"), prompt_ids=[1, 2], completion_ids=[3],
                            usage=Usage(prompt_tokens=2, completion_tokens=1)))
print(run_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
