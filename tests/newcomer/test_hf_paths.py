"""A local-looking ``hf:`` path that does not exist fails at once with "no such directory"
(issue 30, friction 2): the hub is never asked, whether or not ``HF_HUB_OFFLINE`` is set. A real
HTTP server stands in for the hub (``HF_ENDPOINT``) and counts the requests it gets."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from closedloop.cli import main
from closedloop.models import CheckpointNotFoundError, make_client
from closedloop.models.locate import locate_checkpoint, looks_like_hub_id


class CountingHub:
    """An HTTP server that answers 404 to everything and remembers each path asked."""

    def __init__(self) -> None:
        asked: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                asked.append(self.path)
                self.send_response(404)
                self.end_headers()

            do_HEAD = do_GET

            def log_message(self, *args) -> None:
                pass

        self.asked = asked
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "CountingHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "out" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_mistyped_local_path_never_reaches_the_hub(workdir):
    with CountingHub() as hub:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(workdir / "hf-home"))
        done = subprocess.run([sys.executable, "-m", "closedloop", "run", "react", "--model", "hf:out/tinyy",
                               "--input", "What is 3 plus 4?", "--no-store"], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    shown = done.stdout + done.stderr
    assert "'out/tinyy': no such directory" in shown and "holds: tiny" in shown
    assert "Traceback" not in shown and "huggingface.co" not in shown
    assert hub.asked == []


@pytest.mark.parametrize("spec", ["./tiny", "~/no/such/model", "/abs/no/such", "out/tiny/nested/x", "out/other"])
def test_paths_that_can_only_be_paths_are_no_such_directory(workdir, spec):
    assert not looks_like_hub_id(spec)
    with pytest.raises(CheckpointNotFoundError, match="no such directory"):
        make_client(f"hf:{spec}")


def test_existing_paths_must_be_checkpoints(workdir):
    (workdir / "notes.txt").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        locate_checkpoint("notes.txt")
    with pytest.raises(CheckpointNotFoundError, match="has no config.json"):
        locate_checkpoint("out/tiny")


def test_a_hub_id_offline_comes_only_from_the_cache(workdir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(workdir / "empty-hf-home"))
    assert looks_like_hub_id("someorg/somemodel") and looks_like_hub_id("gpt2")
    with pytest.raises(CheckpointNotFoundError, match="not a hub model in the local cache"):
        locate_checkpoint("someorg/somemodel")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert locate_checkpoint("someorg/somemodel") == "someorg/somemodel"  # online: left to the hub


def test_factguard_names_the_missing_model_before_writing_its_data(workdir, capsys):
    rc = main(["eval", "factguard", "--data", "out/fg", "--synthetic", "4", "--model", "hf:out/tiny-vlm",
               "--store", str(workdir / "runs.duckdb")])
    assert rc == 2
    assert "'out/tiny-vlm': no such directory" in capsys.readouterr().out
    assert not (workdir / "out" / "fg").exists()


def test_serve_refuses_a_missing_checkpoint_before_starting(workdir, capsys):
    assert main(["serve", "--model", "hf:out/tinyy", "--port", "1"]) == 2
    assert "no such directory" in capsys.readouterr().err
