"""``closedloop run`` under bad input. With ``--checkpoint F`` and a model spec whose URL carries a
key: the key never reaches the LangGraph checkpoint file, neither in a model turn (its logprob spec
names the backend) nor in the error a failing call leaves in the checkpoint's writes (checked on
the file's bytes, against a real OpenAI-compatible server serving the tiny model). A ``--store``
that is not a run store is one error line, before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

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


@pytest.mark.parametrize("kind", ["directory", "text file", "device"])
def test_a_bad_store_is_one_error_before_the_model_loads(kind, tmp_path, capsys):
    """The model named here does not exist: the error being about the store shows the store was
    checked first (before any weights would load)."""
    text = tmp_path / "notes.txt"
    text.write_text("not a store\n")
    store = {"directory": tmp_path, "text file": text, "device": Path("/dev/null")}[kind]
    if not store.exists():
        pytest.skip(f"no {store} here")
    rc = main(["run", "react", "--model", f"hf:{tmp_path / 'no-model'}", "--store", str(store), "--input", "hi"])
    out = capsys.readouterr()
    assert rc == 2, out.out + out.err
    lines = [line for line in out.out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "no-model" not in lines[0], out.out
    assert "Traceback" not in out.out + out.err
