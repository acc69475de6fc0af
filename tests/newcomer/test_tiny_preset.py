"""The tiny model a newcomer builds answers the README's arithmetic (issue 30, friction 1), and a
build is reused only when its settings are the same (the serve script used to keep any old build).

The ``agent`` preset is built once per session into the shared build cache (``tiny_build_cache``,
which the README blocks use too), then asked through ``closedloop run`` exactly as the README asks."""

from __future__ import annotations

import json
import re

import pytest

from closedloop.cli import main
from closedloop.models.tiny import TINY_CONFIG_FILE, build_key, ensure_tiny_model, tiny_config
from closedloop.models.tiny_presets import preset_settings


def test_the_agent_form_is_what_the_react_graph_sends():
    from closedloop.models.tiny import AGENT_SYSTEM_PROMPT, GREETING, agent_tool_schemas
    from closedloop.evals.tau.orchestrator import GREETING as TAU_GREETING
    from closedloop.plugins import tool_registry
    from closedloop.runtime.context import DEFAULT_SYSTEM_PROMPT

    assert AGENT_SYSTEM_PROMPT == DEFAULT_SYSTEM_PROMPT and GREETING == TAU_GREETING
    ours = agent_tool_schemas()
    for schema in tool_registry(["arithmetic"]).schemas:
        assert ours[schema["function"]["name"]] == schema


def test_a_folder_is_kept_copied_or_rebuilt_by_its_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOSEDLOOP_TINY_CACHE", str(tmp_path / "cache"))
    small = {"train_steps": 2, "n_conversations": 12, "hidden_size": 16, "intermediate_size": 32}
    path, how = ensure_tiny_model(tmp_path / "a", **small)
    assert how == "built"
    assert json.loads((path / TINY_CONFIG_FILE).read_text())["build_key"] == build_key(tiny_config(**small))
    assert ensure_tiny_model(tmp_path / "a", **small)[1] == "kept"
    copy, how = ensure_tiny_model(tmp_path / "b", **small)
    assert how == "cached" and (copy / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    # the serve script's old failure: a folder holding a build with other settings is not reused
    assert ensure_tiny_model(tmp_path / "a", **{**small, "train_steps": 3})[1] == "built"
    monkeypatch.setenv("CLOSEDLOOP_TINY_CACHE", "off")
    assert ensure_tiny_model(tmp_path / "c", **small)[1] == "built"


@pytest.fixture(scope="module")
def agent_tiny(tiny_build_cache, tmp_path_factory):
    """The agent preset, through the shared cache (built once per session, then copied)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CLOSEDLOOP_TINY_CACHE", str(tiny_build_cache))
    try:
        path, _ = ensure_tiny_model(tmp_path_factory.mktemp("agent") / "tiny", **preset_settings("agent"))
    finally:
        mp.undo()
    return path


@pytest.mark.slow
@pytest.mark.parametrize("question, call, answer", [
    ("What is 3 plus 4?", r'add\({"a": 3, "b": 4}\)', "7"),
    ("What is 12 times 5?", r'multiply\({"a": 12, "b": 5}\)', "60"),
])
def test_the_readme_question_gets_the_right_call_and_answer(agent_tiny, capsys, question, call, answer):
    assert main(["run", "react", "--model", f"hf:{agent_tiny}", "--input", question, "--no-store"]) == 0
    out = capsys.readouterr().out
    assert re.search(call, out), out
    shown = out.split("answer", 1)[-1]
    assert re.search(rf"\b{answer}(\.0)?\b", shown), out
