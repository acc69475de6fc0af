"""The ``kernel`` graph (single-agent baseline) with a scripted model and a stand-in evaluator:
rounds, feedback reaching the model, keeping the best correct candidate, bad replies and tools."""

import json

import pytest

from closedloop.graphs.kernel import KernelContext, graph
from closedloop.messages import AssistantMessage, SystemMessage, UserMessage
from closedloop.models.scripted import ScriptedClient

from ._kernel_support import PROBLEM, WRONG_EXPR, fake_kernel_tools, kernel, reply


async def _run(script, rounds, **kw):
    tools, seen = fake_kernel_tools()
    client = ScriptedClient(script)
    out = await graph.ainvoke({"problem": PROBLEM}, context=KernelContext(client=client, tools=tools, rounds=rounds, **kw))
    return out, client, seen


async def test_feedback_reaches_the_model_and_the_fastest_correct_candidate_is_kept():
    wrong = kernel("k-wrong", expr=WRONG_EXPR, verdict={"status": "incorrect", "message": "outputs differ",
                                                         "max_diff": 0.97, "mean_diff": 0.24})
    ok = kernel("k-ok", verdict={"status": "correct", "speedup": 1.2})
    fast = kernel("k-fast", verdict={"status": "correct", "speedup": 1.5})
    out, client, seen = await _run([reply(wrong), reply(ok), reply(fast)], rounds=3)
    assert seen == [wrong, ok, fast]  # every candidate evaluated, in order
    assert out["final_code"] == fast and out["best_result"]["speedup"] == 1.5
    # the model saw the system prompt, the problem, and each verdict before the next attempt
    first = client.calls[0]
    assert isinstance(first[0], SystemMessage) and "load_inline" in first[0].content
    assert "class Model(nn.Module)" in first[1].content
    verdict = client.calls[1][-1]
    assert isinstance(verdict, UserMessage) and '"status": "incorrect"' in verdict.content
    assert '"max_diff": 0.97' in verdict.content and "attempt 1 of 3" in verdict.content
    assert '"speedup": 1.2' in client.calls[2][-1].content
    # one policy turn per round, one tool record per evaluation tied to its turn
    assert len(out["turns"]) == 3 and all(t.trainable for t in out["turns"])
    assert [r.turn_idx for r in out["tool_records"]] == [0, 1, 2]
    assert json.loads(out["tool_records"][0].arguments) == {"code": wrong}
    assert [a["status"] for a in out["attempts"]] == ["incorrect", "correct", "correct"]
    # the last verdict is not sent (no round follows): the conversation ends on the model's reply
    assert out["messages"][-1].type == "ai"


async def test_a_later_regression_does_not_replace_the_best_correct_candidate():
    best = kernel("k-best", verdict={"status": "correct", "speedup": 1.5})
    script = [reply(best), reply(kernel("k-bad", verdict={"status": "incorrect"})),
              reply(kernel("k-slow", verdict={"status": "correct", "speedup": 1.1}))]
    out, _, _ = await _run(script, rounds=3)
    assert out["final_code"] == best and out["best_result"]["status"] == "correct"


async def test_hostile_candidate_is_flagged_back_to_the_model_and_never_kept():
    hostile = kernel("k-hostile", ret="x", verdict={"status": "policy_violation",
                                                     "message": "forward returns an alias of input 0"})
    suspicious = kernel("k-sus", verdict={"status": "suspicious", "speedup": 250.0,
                                          "message": "speedup above 10x: kept out of fast_p until reviewed"})
    out, client, _ = await _run([reply(hostile), reply(suspicious)], rounds=2)
    feedback = client.calls[1][-1].content
    assert "policy_violation" in feedback and "alias of input 0" in feedback
    assert out["best_result"]["status"] == "suspicious"  # nothing correct: the latest candidate, honestly labelled
    out, client, _ = await _run([reply(suspicious), reply(kernel("k-ok"))], rounds=2)
    assert "suspicious" in client.calls[1][-1].content
    assert out["best_result"]["status"] == "correct" and "k-ok" in out["final_code"]


async def test_a_reply_without_code_costs_a_round_and_says_what_to_send():
    out, client, seen = await _run([AssistantMessage(content="I would use OpenMP."), reply(kernel("k-ok"))], rounds=2)
    assert len(seen) == 1  # nothing to evaluate in the first reply
    assert "no ```python code block" in client.calls[1][-1].content
    assert [a["status"] for a in out["attempts"]] == ["no_code", "correct"]
    assert out["tool_records"][0].turn_idx == 1


async def test_stop_when_correct_and_problem_from_a_user_message():
    tools, _ = fake_kernel_tools()
    client = ScriptedClient([reply(kernel("k-ok"))])
    context = KernelContext(client=client, tools=tools, rounds=5, stop_when_correct=True)
    text = f"Please speed this up:\n```python\n{PROBLEM}```"
    out = await graph.ainvoke({"messages": [UserMessage(content=text)]}, context=context)
    assert len(client.calls) == 1 and out["best_result"]["status"] == "correct"
    assert out["problem"].startswith("import torch") and client.calls[0][1].content == text


async def test_an_evaluator_failure_is_reported_and_the_run_continues():
    tools, _ = fake_kernel_tools(fail=True)
    client = ScriptedClient([reply(kernel("k1")), reply(kernel("k2"))])
    out = await graph.ainvoke({"problem": PROBLEM}, context=KernelContext(client=client, tools=tools, rounds=2))
    assert "tool_error" in client.calls[1][-1].content and "sandbox crashed" in client.calls[1][-1].content
    assert out["tool_records"][0].error_kind == "exception"


def test_bad_setup_is_a_clear_error():
    client = ScriptedClient([])
    with pytest.raises(ValueError, match="evaluate_kernel"):
        KernelContext(client=client)
    tools, _ = fake_kernel_tools()
    with pytest.raises(ValueError, match="unknown kernel backend 'rocm'"):
        KernelContext(client=client, tools=tools, backend="rocm")
    with pytest.raises(ValueError, match="rounds"):
        KernelContext(client=client, tools=tools, rounds=0)
    with pytest.raises(ValueError, match="approve and execute_tools=False do not apply"):
        KernelContext(client=client, tools=tools, execute_tools=False)


async def test_input_without_a_problem_is_refused():
    tools, _ = fake_kernel_tools()
    with pytest.raises(ValueError, match="no reference architecture"):
        await graph.ainvoke({"messages": [UserMessage(content="make it fast")]},
                            context=KernelContext(client=ScriptedClient([]), tools=tools))


async def test_a_langchain_thread_works_and_a_new_problem_gets_fresh_rounds():
    from langchain_core.messages import AIMessage, HumanMessage

    from closedloop.runtime import make_checkpointer, with_checkpointer

    tools, seen = fake_kernel_tools()
    client = ScriptedClient([reply(kernel("k1")), reply(kernel("k2")), reply(kernel("k3")), reply(kernel("k4"))])
    kept, context = with_checkpointer(graph, make_checkpointer("memory")), KernelContext(client=client, tools=tools,
                                                                                          rounds=2)
    thread = {"configurable": {"thread_id": "t1"}}
    out = await kept.ainvoke({"messages": [HumanMessage(content=PROBLEM)]}, thread, context=context)
    assert isinstance(out["messages"][-1], AIMessage) and len(seen) == 2
    assert isinstance(out["messages"][2], HumanMessage) and '"status": "correct"' in out["messages"][2].content
    out = await kept.ainvoke({"messages": [HumanMessage(content=PROBLEM.replace("4096", "2048"))]}, thread,
                             context=context)
    assert len(seen) == 4 and "2048" in out["problem"]  # two more rounds, not zero


async def test_a_problem_key_next_to_an_instruction_is_shown_to_the_model():
    tools, _ = fake_kernel_tools()
    client = ScriptedClient([reply(kernel("k1"))])
    await graph.ainvoke({"problem": PROBLEM, "messages": [UserMessage(content="Optimise for latency.")]},
                        context=KernelContext(client=client, tools=tools, rounds=1))
    assert [m.role for m in client.calls[0]] == ["system", "user", "user"]
    assert "class Model(nn.Module)" in client.calls[0][2].content


async def test_closedloop_run_max_turns_is_the_round_budget():
    """``closedloop run kernel --max-turns 2`` sets the standard budget: two rounds (no ``rounds``)."""
    tools, seen = fake_kernel_tools()
    client = ScriptedClient([reply(kernel("k1")), reply(kernel("k2")), reply(kernel("k3"))])
    await graph.ainvoke({"problem": PROBLEM}, context=KernelContext(client=client, tools=tools, max_turns=2))
    assert len(seen) == 2
