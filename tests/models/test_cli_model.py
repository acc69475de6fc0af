import json

from closedloop.cli import main


def test_model_tiny_command_builds_a_loadable_checkpoint(tmp_path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "m"
    assert main(["model", "tiny", str(out), "--seed", "2", "--steps", "2", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert str(out.resolve())[:30] in printed.replace("\n", "")
    assert json.loads((out / "closedloop_tiny.json").read_text())["config"]["train_steps"] == 2
    assert AutoTokenizer.from_pretrained(out).chat_template
