"""The kernel agents' parts: code extraction, the evaluator's verdict, ranking, the profile
agent's JSON, paradigms and prompts."""

import json

import pytest

from closedloop.agents.kernel import prompts
from closedloop.agents.kernel.extract import CodeExtractionError, extract_code, extract_problem
from closedloop.agents.kernel.feedback import EvalResult, better, feedback_json, parse_eval_result
from closedloop.agents.kernel.paradigms import seed_paradigms
from closedloop.agents.kernel.profile import ProfileParseError, parse_profile_plan

from ._kernel_support import PROBLEM, kernel

MOD = "import torch\nclass ModelNew(torch.nn.Module):\n    pass\n"


def test_extract_takes_the_block_that_defines_modelnew():
    text = f"Usage:\n```python\nm = ModelNew()\n```\nCode:\n```python\n{MOD}```\nLater:\n```py\n{MOD.replace('pass', 'x = 1')}```"
    assert extract_code(text) == MOD
    assert "x = 1" in extract_code(text, which="last")
    assert extract_code(f"```\n{MOD}```") == MOD  # an unlabelled fence is python
    assert extract_code(MOD) == MOD  # bare code without fences
    assert extract_code(f"```cpp\nint x;\n```\n```python\n{MOD}```") == MOD


@pytest.mark.parametrize("text, why", [
    ("I would tile the loops.", "no ```python code block"),
    ("```python\nclass Model(nn.Module):\n    pass\n```", "none of your ```python blocks defines `class ModelNew"),
    (f"```python\n{MOD}", "not closed"),
    ("```python\n# class ModelNew is below\n```", "none of your"),
])
def test_extract_errors_tell_the_model_what_to_send(text, why):
    with pytest.raises(CodeExtractionError, match=why.replace("`", ".").replace("(", ".")):
        extract_code(text)


def test_extract_problem():
    assert extract_problem(PROBLEM) == PROBLEM
    assert extract_problem(f"Speed this up\n```python\n{PROBLEM}```") == PROBLEM
    with pytest.raises(ValueError, match="no reference architecture"):
        extract_problem("```python\nx = 1\n```")


def test_eval_result_parsing_keeps_every_field_and_never_invents_a_speedup():
    r = parse_eval_result(json.dumps({"status": "incorrect", "max_diff": 0.5, "traceback": "T" * 5000}))
    assert r.status == "incorrect" and not r.correct and r.model_extra["max_diff"] == 0.5
    shown = json.loads(feedback_json(r, limit=100))
    assert shown["max_diff"] == 0.5 and len(shown["traceback"]) == 101  # the tail, marked as clipped
    untimed = parse_eval_result(json.dumps({"status": "correct", "speedup": "not timed"}))
    assert untimed.speedup is None and untimed.model_extra["speedup_note"] == "not timed"
    assert parse_eval_result("Error: boom", "tool evaluate_kernel raised").status == "tool_error"
    assert parse_eval_result("<html>").status == "tool_error"
    assert parse_eval_result("[1, 2]").status == "tool_error"


def test_ranking_correct_then_faster_and_untimed_never_beats_timed():
    ok = EvalResult(status="correct", speedup=1.2)
    assert better(ok, None) and better(ok, EvalResult(status="incorrect"))
    assert not better(EvalResult(status="suspicious", speedup=50.0), None)
    assert better(EvalResult(status="correct", speedup=1.3), ok)
    assert not better(EvalResult(status="correct", speedup=1.2), ok)  # ties keep the incumbent
    assert not better(EvalResult(status="correct"), ok)
    assert better(ok, EvalResult(status="correct"))


def test_profile_plan_parsing():
    plan = parse_profile_plan('Analysis...\n```json\n{"bottleneck": "memory bound", "modification_plan": "fuse"}\n```')
    assert plan.bottleneck == "memory bound" and plan.modification_plan == ["fuse"]
    bare = parse_profile_plan('Sure: {"bottleneck": "b", "modification_plan": ["a", "c"], "extra": 1} done')
    assert bare.modification_plan == ["a", "c"]
    for text, why in [("no json here", "no JSON object"), ('{"bottleneck": "b"}', "modification_plan"),
                      ('{"bottleneck": "  ", "modification_plan": ["a"]}', "bottleneck"),
                      ('{"bottleneck": "b", "modification_plan": []}', "modification_plan"),
                      ('{"bottleneck": "b", "modification_plan": ["a", 3]}', "modification_plan"),
                      ("[1, 2]", "no JSON object")]:
        with pytest.raises(ProfileParseError, match=why):
            parse_profile_plan(text)


def test_seed_paradigms_are_operator_specific_then_generic_and_distinct():
    conv = seed_paradigms("x = F.conv2d(x, w)", 3)
    assert conv[0].startswith("direct convolution") and conv[1].startswith("im2col")
    soft = seed_paradigms("return torch.softmax(x, dim=1)", 2)
    assert any("online softmax" in p for p in soft)
    plain = seed_paradigms(PROBLEM, 4)
    assert len(set(plain)) == 4 and plain[0].startswith("direct")
    with pytest.raises(ValueError):
        seed_paradigms(PROBLEM, 0)


@pytest.mark.parametrize("backend, needle", [("cpu", "-fopenmp"), ("triton", "@triton.jit"), ("cuda", "__global__")])
def test_prompts_are_backend_specific(backend, needle):
    system = prompts.single_system(backend)
    assert needle in system and "ModelNew" in system
    assert needle in prompts.code_system(backend) and needle in prompts.tune_system(backend)
    assert "modification_plan" in prompts.profile_system(backend)


def test_the_prompts_example_is_a_valid_candidate():
    example = prompts.backend_guide("cpu").split("Example of the format (an elementwise add):\n", 1)[1]
    code = extract_code(example)
    compile(code, "example", "exec")
    compile(kernel("k"), "support", "exec")


async def test_profile_report_puts_the_profile_first_and_long_reports_are_clipped():
    from closedloop.agents.kernel.evaluate import profile_code
    from closedloop.tool import ToolRegistry, tool

    registry = ToolRegistry()

    @tool(registry=registry)
    def profile_kernel(code: str) -> str:
        """Profile.

        Args:
            code: source.
        """
        return json.dumps({"status": "correct", "compiler_log": "x" * 20000, "profile": {"candidate": ["op"]}})

    report, record = await profile_code(registry, "code", call_id="p1")
    assert report.index('"profile"') < report.index('"compiler_log"') and record.name == "profile_kernel"
    task = prompts.profile_task("code", report, "tiling", "tiles", limit=500)
    assert '"profile"' in task and "more characters" in task and len(task) < 1500
    none, rec = await profile_code(ToolRegistry(), "code", call_id="p2")
    assert rec is None and "no profiler" in none


def test_the_agents_know_every_status_the_evaluator_gives():
    """The agents' list is written out (they sit a layer below the evaluator); it must not fall
    behind: an unknown status would be debugged as if the candidate could fix it."""
    from closedloop.agents.kernel.feedback import STATUSES, UNFIXABLE
    from closedloop.evals.kernelbench.evaluate import STATUSES as EVALUATOR_STATUSES

    assert set(STATUSES) == set(EVALUATOR_STATUSES)
    infra = parse_eval_result(json.dumps({"status": "infra_error", "message": "the build cache lost a fresh build"}))
    invalid = parse_eval_result(json.dumps({"status": "invalid_output", "message": "nested too deep"}))
    assert not infra.fixable and "infra_error" in UNFIXABLE  # the evaluator's failure: nothing to debug
    assert invalid.fixable and not invalid.correct  # the candidate's own output: another candidate may do better
