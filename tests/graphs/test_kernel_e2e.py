"""``kernel`` and ``egg`` end to end on the real KernelBench harness (sandboxed build, correctness,
timing, profiler) with a scripted model replaying C++/OpenMP kernels written for a tiny problem.

Builds are cached by source hash in pytest's cache directory and shared by both tests: all the
candidates here share one C++ source (they differ in how ModelNew calls it), so a cold run compiles
once (~40 s on a busy 2-core machine) and a warm run compiles nothing.
"""

import json

import pytest

from closedloop.graphs import egg as egg_graph
from closedloop.graphs import kernel as kernel_graph
from closedloop.messages import AssistantMessage
from closedloop.models.scripted import ScriptedClient

from ._kernel_support import PROBLEM, kernel, reply

kb = pytest.importorskip("closedloop.evals.kernelbench.tools")
from closedloop.evals.kernelbench.evaluate import KernelEvalConfig, backend_available  # noqa: E402
from closedloop.evals.kernelbench.problems import Problem  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not backend_available("cpu")[0], reason="the cpu backend needs g++ and ninja")]

RIGHT = kernel("k-right")
WRONG = kernel("k-wrong", ret="ext.relu_add_scale(x, y, 1.0)")  # ignores the scale
ALIAS = kernel("k-alias", ret="x")                               # hostile: hands back its input


@pytest.fixture(scope="module")
def tools(request):
    cache = request.config.cache.mkdir("closedloop-kernel-builds")
    problem = Problem(level=1, problem_id=1, name="1_ReluAddScale.py", code=PROBLEM)
    config = KernelEvalConfig(backend="cpu", cache_dir=str(cache), trials=3, iters=5, compile_workers=1)
    return kb.make_kernel_tools(problem, "cpu", config=config)


async def test_kernel_graph_on_the_real_harness(tools):
    client = ScriptedClient([reply(ALIAS), reply(WRONG), reply(RIGHT)])
    out = await kernel_graph.graph.ainvoke({"problem": PROBLEM},
                                     context=kernel_graph.KernelContext(client=client, tools=tools, rounds=3))
    statuses = [a["status"] for a in out["attempts"]]
    assert statuses[0] in ("incorrect", "policy_violation") and statuses[1] == "incorrect" and statuses[2] == "correct"
    # the hostile candidate's flag and the wrong one's differences reached the model as feedback
    assert "alias" in client.calls[1][-1].content
    wrong_verdict = client.calls[2][-1].content
    assert '"status": "incorrect"' in wrong_verdict and '"max_diff"' in wrong_verdict
    assert out["final_code"] == RIGHT
    best = out["best_result"]
    assert best["status"] == "correct" and best["timed"] and best["speedup"] > 0


async def test_egg_graph_on_the_real_harness(tools):
    plan = {"bottleneck": "the loop is already parallel", "modification_plan": ["split the loop in two"]}

    def script(messages):
        system = messages[0].content
        if "profile agent" in system:
            return AssistantMessage(content=json.dumps(plan))
        if "stage B" in system:
            return reply(WRONG)  # a "tuned" kernel that changes the numerics
        return reply(RIGHT)

    client = ScriptedClient(script)
    context = egg_graph.EggContext(client=client, tools=tools, paradigms=["direct"], debug_rounds=0, refine_rounds=0,
                             tuning_steps=["parallel_mapping"])
    out = await egg_graph.graph.ainvoke({"problem": PROBLEM}, context=context)
    assert [t.purpose for t in out["turns"]] == ["code", "profile", "tune"]
    # the profiler's real report reached the profile agent
    profile_prompt = client.calls[1][-1].content
    assert '"profile"' in profile_prompt and "relu_add_scale" in profile_prompt
    # the tuned kernel failed correctness: rejected, the last correct kernel kept
    assert out["attempts"][-1]["status"] == "incorrect" and out["stage_b"]["applied"] == []
    assert out["final_code"] == RIGHT and out["best_result"]["status"] == "correct"


async def test_the_harness_runs_the_registered_kernel_graph(tools, request):
    """As ``closedloop eval kernelbench --agent kernel --rounds 1`` calls it (graph_agent); egg takes
    the same run context (its full default run, ~10 evaluations, is too slow for a test: the context only)."""
    from closedloop.runtime import context_for, load_graph

    context_for(load_graph("egg"), client=ScriptedClient([]), tools=tools, backend="cpu", rounds=1)
    from closedloop.evals.kernelbench.evaluate import KernelEvaluator
    from closedloop.evals.kernelbench.runner import graph_agent

    cache = request.config.cache.mkdir("closedloop-kernel-builds")
    evaluator = KernelEvaluator(KernelEvalConfig(backend="cpu", cache_dir=str(cache), trials=3, iters=5,
                                                 compile_workers=1))
    problem = Problem(level=1, problem_id=1, name="1_ReluAddScale.py", code=PROBLEM)
    client = ScriptedClient([reply(RIGHT)], cycle=True)
    run = graph_agent("kernel", client, backend="cpu", rounds=1)
    code, trajectory = await run(problem, 0, evaluator)
    assert code == RIGHT and len(trajectory.turns) == 1 and trajectory.turns[0].trainable
