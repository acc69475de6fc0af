"""``closedloop run --checkpoint F`` with a model spec whose URL carries a key: the key never reaches
the LangGraph checkpoint file, neither in a model turn (its logprob spec names the backend) nor in
the error a failing call leaves in the checkpoint's writes. Checked on the file's bytes, against a
real OpenAI-compatible server (``closedloop.server``) serving the tiny model."""

from __future__ import annotations

from pathlib import Path

from closedloop.cli import main
from closedloop.server import create_app
from closedloop.server.local import serve_app

SECRET = "sk-PLANTEDcheckpointKey0123456789"


def _written(tmp_path: Path, name: str) -> bytes:
    """Every file SQLite wrote for the checkpoint (the database, its WAL and shared memory)."""
    return b"".join(p.read_bytes() for p in sorted(tmp_path.glob(name + "*")))


def test_checkpoint_file_never_holds_the_model_urls_key(tiny_client, tmp_path, capsys):
    ckpt = tmp_path / "threads.sqlite"
    with serve_app(create_app(tiny_client, "tiny")) as url:
        keyed = url.replace("http://", f"http://user:{SECRET}@")
        assert main(["run", "react", "--model", f"openai:tiny@{keyed}", "--input", "What is 2 plus 3?",
                     "--checkpoint", str(ckpt), "--thread", "ok", "--no-store", "--max-turns", "2",
                     "--max-tokens", "32"]) == 0
        # A call the server refuses (unknown model name): the error names the URL.
        assert main(["run", "react", "--model", f"openai:other@{keyed}", "--input", "hi",
                     "--checkpoint", str(ckpt), "--thread", "failing", "--no-store"]) == 1
    shown = capsys.readouterr().out
    assert "answered 404" in shown and SECRET not in shown
    data = _written(tmp_path, ckpt.name)
    assert b"logprob_spec" in data and b"ModelError" in data  # the turn and the error were checkpointed
    assert b"[REDACTED]@127.0.0.1" in data  # with the URL's userinfo redacted
    assert SECRET.encode() not in data and b"PLANTED" not in data
