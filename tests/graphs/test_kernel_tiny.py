"""Mechanics of the kernel graphs with the real tiny model (HF backend): the graphs run to the end
and record every model call as a token-exact turn. The tiny model cannot write kernels, so every
reply is a ``no_code`` round; what breaks here is plumbing (prompt building, recording, routing)."""

import pytest

from closedloop.graphs import egg, kernel
from closedloop.models.base import SamplingParams

from ._kernel_support import PROBLEM, fake_kernel_tools

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0.0, max_tokens=12)


async def test_kernel_graph_runs_on_the_tiny_model(tiny_client):
    tools, _ = fake_kernel_tools()
    context = kernel.KernelContext(client=tiny_client, tools=tools, rounds=2, params=PARAMS)
    out = await kernel.graph.ainvoke({"problem": PROBLEM}, context=context)
    assert len(out["turns"]) == 2 and all(t.has_tokens and t.trainable for t in out["turns"])
    assert [a["round"] for a in out["attempts"]] == [1, 2]
    # the second call saw the first reply and its verdict: its prompt is longer than the first's
    assert len(out["turns"][1].prompt_ids) > len(out["turns"][0].prompt_ids)


async def test_egg_graph_runs_on_the_tiny_model(tiny_client):
    tools, _ = fake_kernel_tools()
    context = egg.EggContext(client=tiny_client, tools=tools, num_seeds=2, debug_rounds=1, params=PARAMS)
    out = await egg.graph.ainvoke({"problem": PROBLEM}, context=context)
    assert [t.purpose for t in out["turns"]] == ["code", "debug", "code", "debug"]
    assert all(t.has_tokens for t in out["turns"])
    assert [a["status"] for a in out["attempts"]] == ["no_code"] * 4
    assert out["handoff"] == {} and out["final_code"] is None  # nothing correct: stage B never starts
