"""``closedloop run`` as a person uses it (issue 30, "The REPL"): chat markup is never shown, an
approval needs an explicit ``y``, a turn that ends without an answer says why, a resumed thread
says it resumed, and ``--input`` prints the answer once.

The model is a backend registered in-process (``rawscript:``) that streams raw text character by
character exactly as a local model does (``<tool_call>`` JSON, ``<|im_end|>``) and then returns the
parsed turn; the real tiny model is checked too (``hf:``, whose stream carries that markup)."""

from __future__ import annotations

import io
from typing import Any, AsyncGenerator

import pytest

from closedloop import plugins
from closedloop.cli import main
from closedloop.cli.run import MarkupFilter
from closedloop.messages import AssistantMessage, ToolCall, Turn, Usage
from closedloop.models.base import ModelClient, TextDelta, TurnDone
from closedloop.store import RunStore

SCRIPT: list[tuple[str, AssistantMessage]] = []

CALL_ADD = ('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
            AssistantMessage(tool_calls=[ToolCall.make("add", {"a": 3, "b": 4}, id="call_1")]))
ANSWER = ("The answer is 7.0.<|im_end|>", AssistantMessage(content="The answer is 7.0."))
MALFORMED = ('<tool_call>\n{"name": " thank you today?<|im_end|>',
             AssistantMessage(content='<tool_call>\n{"name": " thank you today?'))


class RawScript(ModelClient):
    """Replays ``SCRIPT``: streams each raw completion one character at a time, then the parsed turn."""

    spec = "rawscript:test"

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, messages, tools=None, params=None, tool_choice=None) -> Turn:
        raw, message = SCRIPT[self.calls]
        self.calls += 1
        return Turn(message=message.model_copy(deep=True), model=self.spec, usage=Usage(),
                    finish_reason="tool_calls" if message.tool_calls else "stop")

    async def stream(self, messages, tools=None, params=None, tool_choice=None) -> AsyncGenerator[Any, None]:
        raw = SCRIPT[self.calls][0]
        turn = await self.generate(messages, tools, params, tool_choice)
        for ch in raw:
            yield TextDelta(ch)
        yield TurnDone(turn)


plugins.registry("backends").register("rawscript", lambda spec, **kw: RawScript(), replace=True)


def run_cli(monkeypatch, capsys, script, stdin: str, *args: str) -> tuple[int, str]:
    SCRIPT[:] = script
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(["run", "react", "--model", "rawscript:test", *args])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("deltas, shown", [
    (["The ans", "wer is 7.<|im", "_end|>"], "The answer is 7."),
    (["ok <tool", "_call>\n{\"name\"", "}</tool_call><|im_end|>"], "ok "),
    (["a < b and <|", "endoftext|> c"], "a < b and  c"),
])
def test_markup_filter(deltas, shown):
    f = MarkupFilter()
    assert "".join(f.feed(d) for d in deltas) + f.flush() == shown


def test_repl_never_shows_chat_markup(monkeypatch, capsys, tmp_path):
    code, out = run_cli(monkeypatch, capsys, [CALL_ADD, ANSWER], "What is 3 plus 4?\n", "--store",
                        str(tmp_path / "runs.duckdb"))
    assert code == 0
    assert "→ add" in out and "← add: 7" in out and "The answer is 7.0." in out
    assert "<tool_call>" not in out and "<|im_end|>" not in out and "</tool_call>" not in out


def test_an_empty_line_never_approves_a_call(monkeypatch, capsys, tmp_path):
    store = tmp_path / "runs.duckdb"
    code, out = run_cli(monkeypatch, capsys, [CALL_ADD, ANSWER], "What is 3 plus 4?\n\n", "--approve",
                        "--store", str(store))
    assert code == 0
    assert "← add" not in out  # the call never ran
    [run] = RunStore(store).list_runs(limit=None)
    assert run.status == "waiting"


def test_a_denied_call_then_an_unreadable_reply_ends_with_a_message(monkeypatch, capsys, tmp_path):
    code, out = run_cli(monkeypatch, capsys, [CALL_ADD, MALFORMED], "What is 3 plus 4?\nn\n", "--approve",
                        "--store", str(tmp_path / "runs.duckdb"))
    assert code == 0
    assert "declined at the terminal" in out
    assert "could not be read" in out and "no answer: the model's last reply was a tool call" in out
    assert "<|im_end|>" not in out


def test_input_prints_the_answer_once(monkeypatch, capsys, tmp_path):
    code, out = run_cli(monkeypatch, capsys, [CALL_ADD, ANSWER], "", "--input", "What is 3 plus 4?",
                        "--store", str(tmp_path / "runs.duckdb"))
    assert code == 0 and out.count("The answer is 7.0.") == 1


def test_a_resumed_thread_says_it_resumed(monkeypatch, capsys, tmp_path):
    common = ["--checkpoint", str(tmp_path / "ck.sqlite"), "--thread", "T1", "--store", str(tmp_path / "r.duckdb")]
    code, out = run_cli(monkeypatch, capsys, [CALL_ADD, ANSWER], "", "--input", "What is 3 plus 4?", *common)
    assert code == 0 and "resumed thread" not in out
    code, out = run_cli(monkeypatch, capsys, [], "\n", *common)
    assert code == 0 and "resumed thread T1: 4 earlier messages" in out


@pytest.mark.slow
def test_the_tiny_models_stream_shows_no_markup(tiny_model_path, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("What is 3 plus 4?\n"))
    code = main(["run", "react", "--model", f"hf:{tiny_model_path}", "--no-store", "--max-turns", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "→ add" in out
    assert "<tool_call>" not in out and "<|im_end|>" not in out
