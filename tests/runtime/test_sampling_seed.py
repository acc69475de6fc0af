"""The run context's ``params.seed`` seeds the model node: one compiled graph serves many seeded
runs, each sampling as its seed says (what GRPO rollouts and pass@k samples rely on)."""

from closedloop.graphs.react import graph
from closedloop.messages import UserMessage
from closedloop.models.base import SamplingParams
from closedloop.runtime import AgentContext

PARAMS = SamplingParams(temperature=1.0, max_tokens=24)


async def _ids(client, seed):
    context = AgentContext(client=client, system_prompt=None, params=PARAMS.model_copy(update={"seed": seed}))
    out = await graph.ainvoke({"messages": [UserMessage(content="What is 3 plus 4?")]}, context=context)
    return out["turns"][-1].completion_ids


async def test_each_run_samples_with_its_own_seed(tiny_client):
    first = [await _ids(tiny_client, 3), await _ids(tiny_client, 4)]
    assert await _ids(tiny_client, 3) == first[0]  # reproducible
    assert await _ids(tiny_client, 4) == first[1]
    samples = {tuple(await _ids(tiny_client, s)) for s in range(5, 10)}
    assert len(samples) > 1  # the seed is really used
    # the same seed gives the same sample as a direct call with it: the graph adds nothing to sampling
    turn = await tiny_client.generate([UserMessage(content="What is 3 plus 4?")], None,
                                      PARAMS.model_copy(update={"seed": 3}))
    assert turn.completion_ids == first[0]
