"""A CPU kernel written for a problem in KernelBench's format: loading, scaling, policy, verdicts, cache."""

from __future__ import annotations

import asyncio
import json

import pytest

from closedloop.evals.kernelbench.evaluate import KernelEvaluator
from closedloop.evals.kernelbench.policy import check_policy
from closedloop.evals.kernelbench.problems import extract_code, load_problems, problems_from_rows, scale_source
from closedloop.evals.kernelbench.tools import make_kernel_tools

from .conftest import KERNEL, PROBLEMS, RELU_OK, config


def test_load_problems_layout_and_rows(tmp_path):
    ps = load_problems(PROBLEMS)
    assert [(p.level, p.problem_id) for p in ps] == [(1, 1), (1, 2), (1, 3)]
    assert ps[0].name == "1_ReLU.py" and ps[0].key == "level1/1_ReLU.py"
    (tmp_path / "level2").mkdir()
    (tmp_path / "level2" / "README.md").write_text("skip me")
    (tmp_path / "level2" / "7_X.py").write_text("x = 1\n")
    assert [p.problem_id for p in load_problems(tmp_path, level=2)] == [7]
    with pytest.raises(ValueError, match="no problems"):
        load_problems(tmp_path, level=3)
    rows = problems_from_rows([{"code": "a=1", "level": 1, "name": "5_Foo", "problem_id": 5}])
    assert rows[0].name == "5_Foo.py"
    with pytest.raises(ValueError, match="lacks"):
        problems_from_rows([{"code": "a=1"}])


def test_scale_rewrites_module_level_sizes_only():
    code = "N = 4096\nshape = (32768, 64)\ndim = 1\neps = 1e-5\ndef f():\n    return 4096\n"
    new, changed = scale_source(code, 1 / 64)
    ns: dict = {}
    exec(new, ns)
    assert ns["N"] == 64 and ns["shape"] == (512, 1) and ns["dim"] == 1 and ns["eps"] == 1e-5
    assert ns["f"]() == 4096  # function bodies untouched
    assert changed["N"] == [[4096, 64]]


def test_policy_strict_and_lenient():
    torchy = KERNEL + "class ModelNew(nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n"
    assert not check_policy(torchy, "cpu", "strict").ok
    lenient = check_policy(torchy, "cpu", "lenient")
    assert lenient.ok and lenient.warnings
    assert check_policy(RELU_OK, "cpu", "strict").ok
    no_kernel = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x\n"
    assert [v.rule for v in check_policy(no_kernel, "cpu", "lenient").violations] == ["no_kernel"]
    fallback = RELU_OK.replace("        return relu_ext.relu_forward(x)",
                               "        try:\n            return relu_ext.relu_forward(x)\n"
                               "        except Exception:\n            return torch.relu(x)")
    assert "try_except" in {v.rule for v in check_policy(fallback, "cpu", "lenient").violations}
    subclass = RELU_OK.replace("class ModelNew(nn.Module)", "class ModelNew(Model)")
    assert "subclass_reference" in {v.rule for v in check_policy(subclass, "cpu", "lenient").violations}
    aten = RELU_OK.replace("auto out = torch::empty_like(xc);", "auto out = at::relu(xc);")
    assert "aten_compute" in {v.rule for v in check_policy(aten, "cpu", "strict").violations}


def test_correct_cpu_kernel_passes_and_reports_speedup(relu_result):
    r = relu_result
    assert r.status == "correct", r.message + (r.compiler_log or "") + (r.traceback_tail or "")
    assert r.timed and r.speedup is not None and r.speedup > 0
    assert set(r.timings) == {"reference", "candidate"} and r.timings["candidate"]["num_trials"] == 5
    assert r.max_diff == 0.0 and r.scale == 0.25 and r.scaled_constants["dim"] == [[4096, 1024]]
    assert r.sandbox["enforced"]["wall_clock"]


def test_unchanged_candidate_hits_the_build_cache(relu_result, kb_cache, problems):
    assert relu_result.status == "correct"
    again = KernelEvaluator(config(kb_cache)).evaluate(problems[1], RELU_OK)
    assert again.status == "correct" and again.builds and all(b["cached"] for b in again.builds)


def test_compile_error_carries_the_compiler_message(kb_cache, problems):
    broken = RELU_OK.replace("o[i] = in[i] > 0.f ? in[i] : 0.f;", "o[i] = undefined_symbol(in[i]);")
    r = KernelEvaluator(config(kb_cache)).evaluate(problems[1], broken)
    assert r.status == "compile_error"
    assert "undefined_symbol" in (r.compiler_log or "")


def test_wrong_shape_dtype_and_values(relu_result, kb_cache, problems):
    ev = KernelEvaluator(config(kb_cache))
    cases = {
        "shape_mismatch": "        return relu_ext.relu_forward(x)[:, :-1]",
        "dtype_mismatch": "        return relu_ext.relu_forward(x).double()",
        "incorrect": "        return relu_ext.relu_forward(x) * 1.5",
    }
    for status, line in cases.items():
        code = RELU_OK.replace("        return relu_ext.relu_forward(x)", line)
        r = ev.evaluate(problems[1], code)
        assert r.status == status, (status, r.message)
        assert r.message
    r = ev.evaluate(problems[1], RELU_OK.replace("        return relu_ext.relu_forward(x)",
                                                 "        return relu_ext.relu_forward(x, 3)"))
    assert r.status == "runtime_error" and r.traceback_tail


def test_syntax_error_and_missing_modelnew(kb_cache, problems):
    ev = KernelEvaluator(config(kb_cache))
    assert ev.evaluate(problems[1], "def broken(:\n").status == "load_error"
    r = ev.evaluate(problems[1], RELU_OK.replace("class ModelNew", "class Other"))
    assert r.status in ("load_error", "policy_violation")


def test_extract_code():
    text = "Here:\n```python\nA = 1\n```\nthen\n```python\nB = 2\n```\n"
    assert extract_code(text) == "A = 1\n" and extract_code(text, which="last") == "B = 2\n"


def test_kernel_tools(relu_result, kb_cache, problems):
    reg = make_kernel_tools(problems[1], "cpu", config=config(kb_cache))
    assert {t.name for t in reg} == {"evaluate_kernel", "profile_kernel"}
    res = asyncio.run(reg.call_json("evaluate_kernel", {"code": f"```python\n{RELU_OK}```"}))
    body = json.loads(res.content)
    assert body["status"] == "correct" and body["speedup"] > 0
    prof = json.loads(asyncio.run(reg.call_json("profile_kernel", {"code": RELU_OK})).content)
    assert prof["status"] == "correct"
    assert any("relu" in row["op"] for row in prof["profile"]["reference"])


def test_unavailable_backend_says_so(problems, kb_cache):
    r = KernelEvaluator(config(kb_cache, backend="cuda", policy="off")).evaluate(problems[1], RELU_OK)
    import torch

    if not torch.cuda.is_available():
        assert r.status == "load_error" and "not timed" in r.message and not r.timed and r.speedup is None
