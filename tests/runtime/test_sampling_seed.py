"""A run's ``configurable["sampling_seed"]`` seeds the model node: one compiled graph serves many
seeded runs exactly as graphs built with that seed in their params (what GRPO rollouts rely on)."""

import uuid

import pytest

from closedloop.graphs.react import build_react_graph
from closedloop.messages import UserMessage
from closedloop.models.base import SamplingParams
from closedloop.runtime.nodes import SAMPLING_SEED, run_params

PARAMS = SamplingParams(temperature=1.0, max_tokens=24)


async def _ids(graph, seed=None):
    cfg = {"thread_id": uuid.uuid4().hex, **({SAMPLING_SEED: seed} if seed is not None else {})}
    out = await graph.ainvoke({"messages": [UserMessage(content="What is 3 plus 4?")]}, {"configurable": cfg})
    return out["turns"][-1].completion_ids


async def test_run_seed_samples_as_a_graph_built_with_that_seed(tiny_client):
    shared = build_react_graph(tiny_client, None, system_prompt=None, params=PARAMS)
    own = [build_react_graph(tiny_client, None, system_prompt=None, params=PARAMS.model_copy(update={"seed": s}))
           for s in (3, 4)]
    by_config = [await _ids(shared, 3), await _ids(shared, 4)]
    assert by_config == [await _ids(own[0]), await _ids(own[1])]
    assert await _ids(shared, 3) == by_config[0]  # reproducible
    # the run's seed replaces the node's own
    assert await _ids(own[1], 3) == by_config[0]
    samples = {tuple(await _ids(shared, s)) for s in range(5, 10)}
    assert len(samples) > 1  # the seed is really used


def test_run_params():
    assert run_params(PARAMS, None) is PARAMS
    assert run_params(PARAMS, {"configurable": {}}) is PARAMS
    assert run_params(None, {"configurable": {SAMPLING_SEED: 7}}).seed == 7
    assert run_params(PARAMS.model_copy(update={"seed": 1}), {"configurable": {SAMPLING_SEED: 7}}).seed == 7
    with pytest.raises(TypeError, match="sampling_seed"):
        run_params(PARAMS, {"configurable": {SAMPLING_SEED: "7"}})
