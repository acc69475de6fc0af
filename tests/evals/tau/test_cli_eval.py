"""``closedloop eval tau`` as a user runs it: the acceptance command on the anchors' retail train
split, and a run killed (SIGKILL) or interrupted (SIGINT) mid-way in a subprocess, then resumed.

The crash tests use a real OpenAI-compatible server (``closedloop.server`` under uvicorn) for the
user simulator, reached through the ``openai:`` backend. After a set number of calls the server
holds every further request until the test releases it, so "mid-way" is a state the test
controls, not a race: some episodes are stored, the others are waiting on the user.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import uvicorn

from closedloop.cli import main
from closedloop.evals.tau.eval_store import find_eval, load_episodes
from closedloop.evals.tau.orchestrator import STOP
from closedloop.messages import AssistantMessage, Turn, Usage
from closedloop.models.base import ModelClient
from closedloop.server import create_app
from closedloop.store import RunStore

REPO = Path(__file__).resolve().parents[3]
ANCHORS = Path(os.environ.get("TAU2_DATA_DIR") or REPO.parent / "shared" / "anchors")
TASKS = ("cancel", "cancel_nl", "cancel_action", "noop")  # the small root's tasks


def _anchors() -> Path:
    if not (ANCHORS / "tau2" / "domains" / "retail" / "tasks.json").is_file():
        pytest.skip(f"τ anchors not present at {ANCHORS} (set TAU2_DATA_DIR)")
    return ANCHORS


# ---------------------------------------------------------------------- acceptance


@pytest.fixture(scope="module")
def acceptance(tmp_path_factory) -> dict:
    anchors = _anchors()
    tmp = tmp_path_factory.mktemp("acceptance")
    out = tmp / "out.json"
    store = tmp / "runs.duckdb"
    rc = main(["eval", "tau", "--domain", "retail", "--split", "train", "--agent", "oracle", "--data-dir",
               str(anchors), "--trials", "1", "--export", str(out), "--store", str(store), "--name", "acc"])
    return {"rc": rc, "export": json.loads(out.read_text()), "store": RunStore(store)}


def test_acceptance_export_has_every_train_task_with_a_db_match(acceptance):
    assert acceptance["rc"] == 0
    sims = acceptance["export"]["simulations"]
    assert len(sims) == 74 and len({s["task_id"] for s in sims}) == 74
    # without a judge, NL_ASSERTION tasks are ungraded: tau2's reward_info is null, ours says why
    assert all(s["closedloop_reward_info"]["db_check"]["db_match"] is True for s in sims)
    assert all(s["reward_info"] is None or s["reward_info"]["reward"] == 1.0 for s in sims)
    assert all(s["reward_info"] is None for s in sims if "NL_ASSERTION" in s["closedloop_reward_info"]["not_graded"])
    assert isinstance(acceptance["export"]["info"]["environment_info"]["policy"], str)
    assert len(acceptance["export"]["info"]["environment_info"]["policy"]) > 1000
    assert all(s["termination_reason"] == "user_stop" for s in sims)
    exported = acceptance["export"]
    assert len(exported["tasks"]) == 74 and exported["info"]["num_trials"] == 1
    assert exported["info"]["task_split"] == "train" and len(exported["info"]["task_file_sha256"]) == 64
    # tau2's message shape: tool calls with parsed arguments and a requestor
    call = next(m for m in sims[0]["messages"] if m.get("tool_calls"))
    assert isinstance(call["tool_calls"][0]["arguments"], dict) and call["tool_calls"][0]["requestor"] == "assistant"


def test_acceptance_run_is_recorded_as_one_eval_with_a_child_per_episode(acceptance):
    store = acceptance["store"]
    parent = find_eval(store, "acc")
    assert parent.status == "completed" and parent.kind == "eval"
    assert parent.config["split"] == "train" and parent.config["task_file_sha256"] == \
        acceptance["export"]["info"]["task_file_sha256"]
    records = load_episodes(store, parent.id)
    assert len(records) == 74 and all(r.status == "completed" for r in records)
    # tasks judged by NL assertions (no judge here) are listed, and failures in pass^1 (tau2's
    # compute_metrics); every graded episode scores 1
    summary = parent.outcome["summary"]
    graded = [s for s in acceptance["export"]["simulations"] if s["reward_info"] is not None]
    assert 0 < len(graded) < 74 and summary["num_tasks"]["1"] == 74 and summary["avg_reward"] == 1.0
    assert parent.outcome["rewards"]["pass^1"] == len(graded) / 74
    assert summary["ungraded"] == 74 - len(graded) and summary["infrastructure_errors"] == []


FIXTURES = Path(__file__).parent / "fixtures"


def test_telecom_run_is_graded_as_tau2_by_default_and_ours_by_name(tmp_path, capsys):
    """The oracle on the telecom fixture tasks: by default each export's ``db_match`` is tau2's
    for the gold trajectory (false where the user surroundings change on sync) and the file says
    it used tau2's conventions; ``--gold-sync --ungraded exclude --pass-k per-task`` changes
    ``db_match`` (never the reward) and is recorded; import reads the conventions back."""
    tau2 = json.loads((FIXTURES / "expected.json").read_text())["telecom"]["tasks"]
    exports = {}
    for name, flags in (("tau2", []), ("ours", ["--gold-sync", "--ungraded", "exclude", "--pass-k", "per-task"])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "tau", "--domain", "telecom", "--split", "train", "--agent", "oracle", "--data-dir",
                     str(FIXTURES), "--export", str(out), "--store", str(tmp_path / "runs.duckdb"), "--name", name,
                     "--concurrency", "1", *flags]) == 0
        exports[name] = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "tau2's" in printed and "gold_sync=True, ungraded=exclude, pass_k=per-task (not tau2's)" in printed
    assert exports["tau2"]["info"]["conventions"] == {"gold_sync": False, "ungraded": "fail", "pass_k": "capped"}
    assert exports["ours"]["info"]["conventions"] == {"gold_sync": True, "ungraded": "exclude", "pass_k": "per-task"}
    default = {s["task_id"]: s["reward_info"] for s in exports["tau2"]["simulations"]}
    assert {t: r["db_check"]["db_match"] for t, r in default.items()} == \
        {t: v["evaluator"]["db_match"] for t, v in tau2.items()}
    assert False in {r["db_check"]["db_match"] for r in default.values()}
    synced = {s["task_id"]: s["reward_info"] for s in exports["ours"]["simulations"]}
    assert all(r["db_check"]["db_match"] for r in synced.values())
    assert {t: r["reward"] for t, r in synced.items()} == {t: r["reward"] for t, r in default.items()} == \
        {t: 1.0 for t in tau2}

    assert main(["eval", "tau", "import", str(tmp_path / "ours.json")]) == 0
    assert "ungraded=exclude, pass_k=per-task (not tau2's)" in capsys.readouterr().out  # as the file records
    assert main(["eval", "tau", "import", str(tmp_path / "ours.json"), "--ungraded", "fail", "--pass-k", "capped"]) == 0
    assert "gold_sync=True (not tau2's)" in capsys.readouterr().out  # how it was graded stays on record
    assert main(["eval", "tau", "import", str(tmp_path / "ours.json"), "--gold-sync"]) == 2
    assert "graded already" in capsys.readouterr().err


def test_argument_errors_exit_2(tmp_path, capsys):
    store = str(tmp_path / "s.duckdb")
    assert main(["eval", "tau", "--agent", "react", "--data-dir", str(tmp_path), "--store", store]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["eval", "tau", "--agent", "react", "--model", "openai:m@http://127.0.0.1:9/v1",
                 "--data-dir", str(tmp_path), "--store", store]) == 2
    assert "--user-model" in capsys.readouterr().err
    assert main(["eval", "tau", "--agent", "oracle", "--data-dir", str(tmp_path), "--store", store]) == 2
    assert "not a τ data root" in capsys.readouterr().err
    assert main(["eval", "tau", "--agent", "oracle", "--data-dir", str(tmp_path), "--store", store,
                 "--user-model", "gpt-4"]) == 2
    assert "model spec" in capsys.readouterr().err


def test_dead_user_server_is_an_infrastructure_error_not_a_failure(mini_root, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["eval", "tau", "--agent", "oracle", "--user-model", "openai:x@http://127.0.0.1:9/v1",
               "--data-dir", str(mini_root), "--split", "train", "--concurrency", "2",
               "--store", str(tmp_path / "s.duckdb"), "--name", "dead", "--export", str(out)])
    assert rc == 1  # every episode an infrastructure error: above --max-infra-errors, so the command fails
    captured = capsys.readouterr()
    text = captured.out
    assert "infra errors" in text and "re-run on resume" in text
    assert "2 of 2 episodes (100%) ended in infrastructure errors" in captured.err
    sims = json.loads(out.read_text())["simulations"]
    assert len(sims) == 2 and {s["termination_reason"] for s in sims} == {"infrastructure_error"}
    parent = find_eval(RunStore(tmp_path / "s.duckdb"), "dead")
    summary = parent.outcome["summary"]
    assert summary["pass_hat_k"] == {} and len(summary["infrastructure_errors"]) == 2


# ---------------------------------------------------------------------- crash and resume


class GatedUser(ModelClient):
    """The user side behind the test server: the reason for calling, then ``###STOP###``.
    Calls after the first ``open_calls`` wait until ``gate`` is set."""

    spec = "gated-user"

    def __init__(self, open_calls: int) -> None:
        self.open_calls = open_calls
        self.calls = 0
        self.gate = threading.Event()

    async def generate(self, messages, tools=None, params=None, tool_choice=None) -> Turn:
        self.calls += 1
        if self.calls > self.open_calls:
            while not self.gate.is_set():
                await asyncio.sleep(0.02)
        spoken = sum(1 for m in messages if m.role == "assistant")
        text = "I want to cancel order #W1." if spoken == 0 else STOP
        return Turn(message=AssistantMessage(content=text), model=self.spec,
                    usage=Usage(prompt_tokens=5, completion_tokens=2))


@contextlib.contextmanager
def serve(client: ModelClient) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(client, "user"), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "user server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if isinstance(client, GatedUser):
            client.gate.set()
        server.should_exit = True
        thread.join(timeout=10)


def _command(root: Path, store: Path, url: str) -> list[str]:
    return ["eval", "tau", "--agent", "oracle", "--user-model", f"openai:user@{url}", "--data-dir", str(root),
            "--trials", "2", "--concurrency", "2", "--store", str(store), "--name", "crash"]


def _stall(proc: subprocess.Popen, user: GatedUser, store: RunStore) -> int:
    """Wait until the run is stuck on the held user calls with its finished episodes stored."""
    deadline = time.monotonic() + 60
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        parent = find_eval(store, "crash")
        n = len(load_episodes(store, parent.id)) if parent else 0
        if n != last:
            last, since = n, time.monotonic()
        elif user.calls > user.open_calls and n > 0 and time.monotonic() - since > 1.0:
            return n
        time.sleep(0.2)
    raise AssertionError(f"the run never stalled (stored {last}, user calls {user.calls})")


def _check_complete(store: RunStore, attempts: int) -> None:
    parent = find_eval(store, "crash")
    records = load_episodes(store, parent.id)
    keys = [r.key for r in records]
    assert len(keys) == 8 and sorted(keys) == sorted((t, k) for t in TASKS for k in (0, 1))  # none lost, none twice
    assert all(r.status == "completed" for r in records)
    assert parent.status == "completed" and parent.metadata["attempts"] == attempts


@pytest.mark.parametrize("sig, status, rc", [(signal.SIGKILL, "killed", -signal.SIGKILL),
                                             (signal.SIGINT, "interrupted", 130)])
def test_killed_or_interrupted_run_resumes_without_losing_or_repeating_episodes(mini_root, tmp_path, sig, status,
                                                                                rc, capsys):
    store_path = tmp_path / "runs.duckdb"
    store = RunStore(store_path)
    user = GatedUser(open_calls=6)  # 2 calls per episode: a few episodes finish, the rest wait
    env = {**os.environ, "CLOSEDLOOP_HOME": str(tmp_path / "home")}
    with serve(user) as url:
        # SIGINT back to its default in the child: a shell that starts the suite in the background
        # ignores it, and an ignored signal stays ignored across exec.
        proc = subprocess.Popen([sys.executable, "-m", "closedloop", *_command(mini_root, store_path, url)],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            stored = _stall(proc, user, store)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == rc, err[-3000:]
        assert 0 < stored < 8
        parent = find_eval(store, "crash")  # reading the store marks a dead writer's run killed
        assert parent.status == status
        assert len(load_episodes(store, parent.id)) == stored  # finished episodes were kept, the rest not
        if sig == signal.SIGINT:
            assert "--name crash" in err
        user.gate.set()
        capsys.readouterr()
        assert main(_command(mini_root, store_path, url)) == 0  # same --name: resumes
    assert f"ran {8 - stored}, from store {stored}" in capsys.readouterr().out
    _check_complete(store, attempts=2)
