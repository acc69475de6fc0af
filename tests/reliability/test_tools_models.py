"""A model argument names only what the operator allows: checkpoints inside the working root, endpoints listed.

Issue 26: ``culture_mt_judge`` passed its ``judge_model`` to the OpenAI client, so a caller's URL
received the server's ``OPENAI_API_KEY``; ``hf:<dir>`` in ``cgp_probe_hf``, ``ziprerank_*``,
``fog_layer_attribution`` and ``culture_mt_judge`` loaded any directory, and errors told which
existed. (The key never reaching a listener over the CLI and MCP: tests/mcp/test_mcp_server.py.)
"""

from __future__ import annotations

import re

import pytest
from pydantic import TypeAdapter

import closedloop.tool_model_entries as tool_model_entries
from closedloop import plugins
from closedloop.tool_models import MODELS_ENV, ModelNotAllowed, allow_model, allowed_models, check_model

# Every tool parameter that takes a model (the known ones; the audit below finds any new one).
MODEL_PARAMETERS = {("cgp_probe_hf", "model"), ("ziprerank_rerank", "model"), ("ziprerank_evaluate", "model"),
                    ("fog_layer_attribution", "model"), ("culture_mt_judge", "judge_model")}
NAMES_A_MODEL = re.compile(r"model|url|endpoint|base_url|api", re.I)
DESCRIBES_A_MODEL = re.compile(r"\bhf:|openai:|vllm:|model spec|checkpoint|base.?url|endpoint", re.I)


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """cwd = work/ (holding a checkpoint-like dir and a link out), a model directory outside it."""
    work, outside = tmp_path / "work", tmp_path / "outside"
    for d in (work / "ckpt", outside / "model"):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    (work / "link").symlink_to(outside / "model")
    monkeypatch.chdir(work)
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(work / "artifacts"))
    monkeypatch.delenv("CLOSEDLOOP_WORKING_ROOTS", raising=False)  # only work/ and its artifacts
    monkeypatch.delenv(MODELS_ENV, raising=False)
    monkeypatch.setattr(tool_model_entries, "ADDED", [])
    return work, outside


def _checker(tool_name: str, parameter: str):
    field = plugins.tool_registry().get(tool_name).args_model.model_fields[parameter]
    from typing import Annotated

    return TypeAdapter(Annotated[(field.annotation, *field.metadata)])


def test_every_argument_that_names_a_model_or_endpoint_is_checked(layout):
    """An audit over every registered tool: a parameter whose name or description speaks of a
    model, URL or endpoint must refuse a caller's URL while the arguments are validated."""
    found = set()
    for t in plugins.tool_registry():
        for name, prop in t.parameters.get("properties", {}).items():
            if NAMES_A_MODEL.search(name) or DESCRIBES_A_MODEL.search(prop.get("description", "")):
                if "string" not in str(prop):  # numbers and lists of numbers name nothing
                    continue
                found.add((t.name, name))
    assert found >= MODEL_PARAMETERS  # the audit sees the parameters we know of
    for tool_name, parameter in sorted(found):
        adapter = _checker(tool_name, parameter)
        with pytest.raises(ValueError, match="operator allows"):
            adapter.validate_python("openai:m@http://127.0.0.1:9/v1")


@pytest.mark.parametrize("tool_name, parameter", sorted(MODEL_PARAMETERS))
async def test_directories_outside_the_root_are_refused_alike_before_the_tool_runs(layout, tool_name, parameter):
    work, outside = layout
    t = plugins.tool_registry().get(tool_name)
    base = {"cgp_probe_hf": {"texts": ["a", "b"], "labels": [0, 1]},
            "ziprerank_rerank": {"query": "q", "candidates": ["a"]},
            "ziprerank_evaluate": {"ranking_set": "set.jsonl"},
            "fog_layer_attribution": {"texts": ["a"]},
            "culture_mt_judge": {"notes_path": "n.jsonl", "hypotheses_path": "h.txt"}}[tool_name]

    async def error(model: str) -> str:
        r = await t.run({**base, parameter: model})
        assert r.error_kind == "invalid_arguments", r.error  # refused in validation: the tool never ran
        return r.error.replace(model.partition(":")[2], "<dir>")

    existing = await error(f"hf:{outside / 'model'}")
    assert "outside the working root" in existing and str(outside) not in existing and str(work) not in existing
    assert existing == await error(f"hf:{outside / 'missing'}")  # the same words whether it exists or not
    assert existing == await error("hf:../outside/model") == await error("hf:../outside/missing")
    assert existing == await error("hf:link")  # a link inside pointing out is outside
    assert existing == (await error(f"vllm:{outside / 'model'}")).replace("vllm", "hf")
    assert "operator allows" in await error("hf:Qwen/Qwen2-0.5B")  # a hub download is remote


def test_a_checkpoint_inside_the_root_is_handed_on_resolved(layout):
    work, _ = layout
    assert check_model("hf:ckpt") == f"hf:{(work / 'ckpt').resolve()}"
    assert check_model(f"vllm:{work / 'ckpt'}") == f"vllm:{(work / 'ckpt').resolve()}"
    with pytest.raises(ModelNotAllowed, match="no checkpoint directory there"):
        check_model("hf:./nothing-here")  # inside the root, saying so reveals nothing outside it
    for hostile in ("hf:a\x00b", "hf:" + "x" * 5000, "hf:" + "y/" * 3000, "openai:" + "z" * 100_000, "z" * 100_000):
        with pytest.raises(ValueError) as info:
            check_model(hostile)
        assert len(str(info.value)) < 1000  # a message, not the argument echoed back


def test_endpoints_and_hub_models_need_the_operators_allowance(layout, monkeypatch):
    url = "http://127.0.0.1:8000/v1"
    for spec in ("openai:gpt-4o", f"openai:m@{url}", "hf:Qwen/Qwen2-0.5B", "vllm:gpt2"):
        with pytest.raises(ModelNotAllowed, match="operator allows"):
            check_model(spec)
    monkeypatch.setenv(MODELS_ENV, f"openai:gpt-4o*, openai:*@{url}/, hf:Qwen/*")
    assert check_model("openai:gpt-4o-mini") == "openai:gpt-4o-mini"  # the configured endpoint
    assert check_model(f"openai:anything@{url}") == f"openai:anything@{url}"  # exactly that URL
    assert check_model("hf:Qwen/Qwen2-0.5B") == "hf:Qwen/Qwen2-0.5B"
    for spec in (f"openai:gpt-4o@{url}/../x", "openai:gpt-4o@http://127.0.0.1:8001/v1",  # another URL, same model
                 "openai:m@http://u:k@127.0.0.1:8000/v1", "openai:o1", "hf:Qwen/../../etc", "hf:Other/x",
                 "vllm:Qwen/Qwen2-0.5B"):
        with pytest.raises(ModelNotAllowed):
            check_model(spec)
    with pytest.raises(ModelNotAllowed) as info:
        check_model("openai:o1")
    assert url not in str(info.value)  # a refusal never lists what the operator allows


def test_entries_are_checked_and_added_for_the_process(layout, monkeypatch):
    assert allowed_models() == []
    assert allow_model(" openai:judge@http://127.0.0.1:9/v1 ") == "openai:judge@http://127.0.0.1:9/v1"
    assert check_model("openai:judge@http://127.0.0.1:9/v1")
    for bad in ("judge", "openai:*@http://127.0.0.1:*/v1", "openai:m@ftp://host"):
        with pytest.raises(ValueError, match=MODELS_ENV):
            allow_model(bad)
    monkeypatch.setenv(MODELS_ENV, "not-a-spec")
    with pytest.raises(ValueError, match=MODELS_ENV):
        allowed_models()
