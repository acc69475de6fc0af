"""The ``egg`` graph (paper 2) with a scripted model and a stand-in evaluator: the two stages, the
stage-isolation rule (no stage-A attempt reaches a stage-B prompt), tuning that never trades
correctness, the profile agent's JSON with counted re-asks, and the recorded turns."""

import json
import re
from collections import defaultdict

import pytest

from closedloop.graphs.egg import EggContext, graph
from closedloop.messages import AssistantMessage
from closedloop.models.scripted import ScriptedClient

from ._kernel_support import PROBLEM, WRONG_EXPR, fake_kernel_tools, kernel, reply

PARADIGMS = ["P-direct loops", "P-blocked tiles", "P-fused pass"]
PLAN = {"bottleneck": "one thread does all the work", "modification_plan": ["parallelise the outer loop"]}


def _tag(text: str) -> str | None:
    m = re.search(r"^# ([AB]-\S+)$", text, re.M)
    return m.group(1) if m else None


class EggScript:
    """Replies by role: seeds by paradigm, refine, debug by the failing kernel's tag, profile, tune by step."""

    def __init__(self, replies: dict, profile: list | None = None):
        self.replies = {k: list(v) for k, v in replies.items()}
        self.profile = list(profile) if profile is not None else None
        self.roles: list[str] = []
        self.used = defaultdict(int)

    def key(self, messages) -> str:
        system, task = messages[0].content, messages[1].content
        if "profile agent" in system:
            return "profile"
        if "debug agent" in system:
            return "debug:" + _tag(task)
        if "stage B" in system:
            return "tune:" + re.search(r"Tuning step: ([a-z ]+) -", task).group(1)
        if "Refine the algorithm" in task:
            return "refine"
        return "seed:" + next(p for p in PARADIGMS if p in task)

    def __call__(self, messages) -> AssistantMessage:
        key = self.key(messages)
        self.roles.append(key.split(":")[0])
        if key == "profile":
            if self.profile:
                return AssistantMessage(content=self.profile.pop(0))
            return AssistantMessage(content=f"```json\n{json.dumps(PLAN)}\n```")
        return reply(self.replies[key].pop(0))


def _k(tag, status="correct", speedup=None, **extra):
    expr = WRONG_EXPR if status == "incorrect" else None
    verdict = {"status": status, "speedup": speedup, **extra}
    return kernel(tag, verdict=verdict, **({"expr": expr} if expr else {}))


STAGE_A = {
    "seed:P-direct loops": [_k("A-seed1", "compile_error", message="error: A-SEED1-COMPILE-LOG expected ';'")],
    "debug:A-seed1": [_k("A-debug1", speedup=1.1)],
    "seed:P-blocked tiles": [_k("A-seed2", speedup=1.3)],
    "seed:P-fused pass": [_k("A-seed3", "incorrect", max_diff=0.9, message="A-SEED3-DIFF")],
    "debug:A-seed3": [_k("A-debug3", "runtime_error", message="A-DEBUG3-TRACEBACK")],
    "debug:A-debug3": [_k("A-debug3b", speedup=0.9)],
    "refine": [_k("A-refined", speedup=1.6)],
}
STAGE_A_ATTEMPT_TEXT = ["A-seed1", "A-debug1", "A-seed2", "A-seed3", "A-debug3", "A-SEED1-COMPILE-LOG", "A-SEED3-DIFF",
                        "A-DEBUG3-TRACEBACK", "P-direct loops", "P-fused pass"]


async def _run(replies, profile=None, **kw):
    tools, seen = fake_kernel_tools()
    script = EggScript(replies, profile)
    client = ScriptedClient(script)
    options = dict(paradigms=PARADIGMS, debug_rounds=2, refine_rounds=1) | kw
    out = await graph.ainvoke({"problem": PROBLEM}, context=EggContext(client=client, tools=tools, **options))
    return out, client, script, seen


def _text(call) -> str:
    return "\n".join(m.text for m in call)


async def test_two_stages_end_to_end_and_no_stage_a_attempt_reaches_stage_b():
    replies = dict(STAGE_A)
    replies.update({"tune:parallel mapping": [_k("B-par", speedup=2.0)],
                    "tune:tiling": [_k("B-tile", "incorrect", max_diff=0.5)],
                    "debug:B-tile": [_k("B-tile2", "incorrect", max_diff=0.4)],
                    "debug:B-tile2": [_k("B-tile3", "incorrect", max_diff=0.3)],
                    "tune:memory": [_k("B-mem", speedup=2.4)]})
    out, client, script, seen = await _run(replies)

    # stage A: three seeds in fresh contexts, debugged until correct, then refinement of the best
    assert script.roles[:7] == ["seed", "debug", "seed", "seed", "debug", "debug", "refine"]
    assert "A-seed1" not in _text(client.calls[2])  # each seed starts from the problem alone
    assert out["stage_a"]["paradigm"] == "P-blocked tiles"
    assert [s["status"] for s in out["stage_a"]["seeds"]] == ["correct", "correct", "correct"]
    assert "A-seed2" in _text(client.calls[6])  # the refinement starts from the best seed

    # only the decision and the final kernel cross
    assert set(out["handoff"]) == {"decision", "code", "result"}
    assert "A-refined" in out["handoff"]["code"] and "P-blocked tiles" in out["handoff"]["decision"]
    first_b = script.roles.index("profile")
    assert first_b == 7 and all(r in ("profile", "tune", "debug") for r in script.roles[first_b:])
    for call in client.calls[first_b:]:
        text = _text(call)
        leaked = [s for s in STAGE_A_ATTEMPT_TEXT if s in text]
        assert not leaked, f"stage-A attempt text in a stage-B prompt: {leaked}"
    assert "A-refined" in _text(client.calls[first_b])

    # stage B in order; the failing tiling candidate is rejected and the last correct kernel kept
    tune_steps = [re.search(r"Tuning step: ([a-z ]+) -", c[1].content).group(1)
                  for c, r in zip(client.calls, script.roles) if r == "tune"]
    assert tune_steps == ["parallel mapping", "tiling", "memory"]
    memory_call = [c for c, r in zip(client.calls, script.roles) if r == "tune"][2]
    assert "B-par" in memory_call[1].content and "B-tile" not in _text(memory_call)
    assert out["stage_b"]["applied"] == ["parallel_mapping", "memory"]
    assert "B-mem" in out["final_code"] and out["best_result"]["speedup"] == 2.4
    assert out["messages"][-1].content.startswith("```python") and "B-mem" in out["messages"][-1].content

    # every model call is a recorded turn with its role; every candidate was evaluated once
    assert len(out["turns"]) == len(client.calls) == len(script.roles)
    assert [t.purpose for t in out["turns"]] == [{"seed": "code"}.get(r, r) for r in script.roles]
    assert all(t.trainable for t in out["turns"])
    evaluated = [json.loads(r.arguments)["code"] for r in out["tool_records"] if r.name == "evaluate_kernel"]
    assert evaluated == seen and len(seen) == len(script.roles) - script.roles.count("profile")
    assert sum(r.name == "profile_kernel" for r in out["tool_records"]) == 3


async def test_tuning_never_trades_correctness_or_speed():
    replies = dict(STAGE_A)
    replies.update({"tune:parallel mapping": [_k("B-par", "incorrect", max_diff=1e-2)],
                    "debug:B-par": [_k("B-par2", "shape_mismatch")],
                    "tune:tiling": [_k("B-tile", speedup=1.2)],       # correct but slower than 1.6
                    "tune:memory": [_k("B-mem", "suspicious", speedup=40.0)],
                    "debug:B-mem": [_k("B-mem2", "suspicious", speedup=35.0)]})
    out, _, script, _ = await _run(replies, debug_rounds=1)
    assert script.roles[-8:] == ["profile", "tune", "debug", "profile", "tune", "profile", "tune", "debug"]
    assert out["stage_b"]["applied"] == []
    assert "A-refined" in out["final_code"]
    assert out["best_result"]["status"] == "correct" and out["best_result"]["speedup"] == 1.6


async def test_invalid_profile_json_is_reasked_and_counted():
    replies = dict(STAGE_A)
    replies.update({"tune:parallel mapping": [_k("B-par", speedup=2.0)]})
    bad = ["I think it is memory bound.", '{"bottleneck": "", "modification_plan": ["x"]}']
    out, client, script, _ = await _run(replies, profile=bad, tuning_steps=["parallel_mapping"])
    assert out["profile_reasks"] == 2
    profiles = [(c, t) for c, t, r in zip(client.calls, out["turns"], script.roles) if r == "profile"]
    assert [t.purpose for _, t in profiles] == ["profile_invalid", "profile_invalid", "profile"]
    assert [t.trainable for _, t in profiles] == [False, False, True]
    reask = profiles[1][0][-1].content
    assert "could not be used" in reask and "no JSON object" in reask
    assert "bottleneck: String should have at least 1 character" in profiles[2][0][-1].content
    tune = next(c for c, r in zip(client.calls, script.roles) if r == "tune")
    assert "one thread does all the work" in tune[1].content  # the valid plan reaches the code agent


async def test_a_profile_agent_that_never_answers_in_json_does_not_stop_tuning():
    replies = dict(STAGE_A)
    replies.update({"tune:parallel mapping": [_k("B-par", speedup=2.0)]})
    out, client, script, _ = await _run(replies, profile=["nope"], tuning_steps=["parallel_mapping"], max_reasks=0)
    assert out["profile_reasks"] == 0 and script.roles.count("profile") == 1
    tune = next(c for c, r in zip(client.calls, script.roles) if r == "tune")
    assert "profile agent's analysis" not in tune[1].content
    assert out["stage_b"]["applied"] == ["parallel_mapping"]


async def test_without_a_correct_design_stage_b_is_skipped():
    replies = {"seed:P-direct loops": [_k("A-x", "compile_error")], "debug:A-x": [_k("A-y", "incorrect")]}
    out, _, script, _ = await _run(replies, paradigms=PARADIGMS[:1], debug_rounds=1)
    assert script.roles == ["seed", "debug"]
    assert out["handoff"] == {} and out["stage_b"] == {}
    assert "A-y" in out["final_code"] and out["best_result"]["status"] == "incorrect"


def test_bad_options_are_clear_errors():
    tools, _ = fake_kernel_tools()
    client = ScriptedClient([])
    with pytest.raises(ValueError, match="in the order"):
        EggContext(client=client, tools=tools, tuning_steps=["tiling", "parallel_mapping"])
    with pytest.raises(ValueError, match="unknown tuning steps"):
        EggContext(client=client, tools=tools, tuning_steps=["vectorise"])
    with pytest.raises(ValueError, match="num_seeds"):
        EggContext(client=client, tools=tools, num_seeds=0)
    with pytest.raises(ValueError, match="the egg graph needs an `evaluate_kernel"):
        EggContext(client=client)


async def test_rounds_is_the_write_and_debug_budget_of_each_task():
    replies = {"seed:P-direct loops": [_k("A-x", "compile_error")], "debug:A-x": [_k("A-y", "incorrect")],
               "debug:A-y": [_k("A-z", "incorrect")]}
    out, _, script, _ = await _run(replies, paradigms=PARADIGMS[:1], rounds=2)
    assert script.roles == ["seed", "debug"]
    with pytest.raises(ValueError, match="rounds"):
        EggContext(client=ScriptedClient([]), tools=fake_kernel_tools()[0], rounds=0)
