"""Hostile candidates (issue 8, section 3): each is contained and ends with a clear status, and the
harness keeps going. Most use the session's shared ReLU kernel (one build for all of them).

Each runs with the static policy switched off where the policy would stop it before it runs,
so the runtime containment itself is what is tested; the policy verdict is checked separately.
"""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest

from closedloop.evals.kernelbench.evaluate import KernelEvaluator
from closedloop.evals.kernelbench.policy import check_policy

from .conftest import KERNEL, config


def candidate(body: str, prelude: str = "") -> str:
    return KERNEL + prelude + "\n\nclass ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n\n" \
        "    def forward(self, x):\n" + "\n".join("        " + ln for ln in body.strip("\n").splitlines()) + "\n"


def run(kb_cache, problem, code: str, *, policy: str = "off", **kw):
    return KernelEvaluator(config(kb_cache, policy=policy, **kw)).evaluate(problem, code)


@pytest.fixture(scope="module", autouse=True)
def _built(relu_result):
    assert relu_result.status == "correct"  # the shared kernel is in the cache before the hostile ones run


def test_returns_input_alias(kb_cache, problems):
    r = run(kb_cache, problems[3], candidate("relu_ext.relu_forward(x)\nreturn x"), policy="strict")
    assert r.status == "incorrect" and "aliases an input" in r.message


def test_result_cached_by_pointer(kb_cache, problems):
    code = candidate("key = (x.data_ptr(), tuple(x.shape))\nif key not in _CACHE:\n"
                     "    _CACHE[key] = relu_ext.relu_forward(x)\nreturn _CACHE[key]", prelude="_CACHE = {}\n")
    r = run(kb_cache, problems[1], code, policy="strict")
    assert r.status == "incorrect", r.message
    assert "recheck" in r.message or "trial" in r.message


def test_zeroes_its_inputs(kb_cache, problems):
    code = candidate("out = torch.zeros_like(x)\nrelu_ext.relu_forward(x)\nx.zero_()\nreturn out")
    r = run(kb_cache, problems[1], code, policy="strict")
    assert r.status == "incorrect" and "modified input" in r.message


def test_returns_torch_empty(kb_cache, problems):
    code = candidate("relu_ext.relu_forward(x)\nreturn torch.empty_like(x)")
    r = run(kb_cache, problems[1], code, policy="strict")
    assert r.status == "incorrect"


@pytest.mark.parametrize("patch", [
    "import time\ntime.perf_counter_ns = lambda: 0\ntime.perf_counter = lambda: 0.0\n",
    "torch.allclose = lambda *a, **k: True\ntorch.equal = lambda *a, **k: True\n",
    "torch.relu = lambda t: t.clone()\n",  # changes what the reference computes
    "torch.nn.Module.__call__ = lambda self, *a, **k: a[0].clone()\n",
])
def test_monkeypatching_is_caught(kb_cache, problems, patch):
    code = candidate("return relu_ext.relu_forward(x)", prelude=patch)
    assert not check_policy(code, "cpu", "lenient").ok  # the static policy stops it first ...
    r = run(kb_cache, problems[1], code)  # ... and the runtime guard when the policy is off
    assert r.status == "policy_violation" and "patched" in r.message


def test_spawns_a_thread(kb_cache, problems):
    code = candidate("out = relu_ext.relu_forward(x)\nthreading.Thread(target=time.sleep, args=(300,)).start()\nreturn out",
                     prelude="import threading\nimport time\n")
    assert "forbidden_import" in {v.rule for v in check_policy(code, "cpu", "lenient").violations}
    r = run(kb_cache, problems[1], code)
    assert r.status == "policy_violation" and "thread" in r.message


def test_spawns_a_process(kb_cache, problems):
    code = candidate("out = relu_ext.relu_forward(x)\nsubprocess.Popen(['sleep', '300'])\nreturn out",
                     prelude="import subprocess\n")
    r = run(kb_cache, problems[1], code)
    assert r.status == "policy_violation" and "process" in r.message


def test_fork_bomb(kb_cache, problems):
    code = candidate("for _ in range(5000):\n    if os.fork() == 0:\n        time.sleep(120)\n        os._exit(0)\n"
                     "return relu_ext.relu_forward(x)", prelude="import os\nimport time\n")
    r = run(kb_cache, problems[1], code)
    if not r.sandbox["enforced"].get("processes"):
        pytest.skip("no process cap here (RLIMIT_NPROC as root, no writable pids cgroup)")
    assert r.status in ("runtime_error", "timeout") and r.status != "correct", r.message


def test_infinite_loop(kb_cache, problems):
    code = candidate("while True:\n    pass")
    lim = config(kb_cache).limits.model_copy(update={"cpu_s": 15, "wall_s": 40})
    r = run(kb_cache, problems[1], code, limits=lim)
    assert r.status == "timeout", r.message


def test_segfault(kb_cache, problems):
    code = candidate("ctypes.string_at(0)\nreturn relu_ext.relu_forward(x)", prelude="import ctypes\n")
    r = run(kb_cache, problems[1], code)
    assert r.status == "runtime_error" and "crash" in r.message and r.sandbox["signal"] == "SIGSEGV"


def test_allocates_until_killed(kb_cache, problems):
    code = candidate("hoard = []\nwhile True:\n    hoard.append(torch.ones(1 << 26))")
    r = run(kb_cache, problems[1], code)
    assert r.status == "runtime_error" and ("memory" in r.message.lower() or "allocat" in r.message.lower()), r.message


def test_opens_a_socket(kb_cache, problems):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    code = candidate(f"socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
                     "return relu_ext.relu_forward(x)", prelude="import socket\n")
    try:
        r = run(kb_cache, problems[1], code)
        with pytest.raises(OSError):
            srv.accept()  # nothing reached us
    finally:
        srv.close()
    if r.sandbox["enforced"].get("network"):
        assert r.status == "runtime_error" and "forward raised" in r.message


def test_writes_outside_its_directory(kb_cache, problems, tmp_path):
    target = Path("/tmp") / f"closedloop-escape-{uuid.uuid4().hex}"
    code = candidate(f"open({str(target)!r}, 'w').write('pwned')\nreturn relu_ext.relu_forward(x)")
    assert "forbidden_call" in {v.rule for v in check_policy(code, "cpu", "lenient").violations}
    r = run(kb_cache, problems[1], code)
    if not r.sandbox["enforced"].get("filesystem"):
        pytest.skip("Landlock unavailable here")
    assert r.status == "runtime_error" and "PermissionError" in r.message
    assert not target.exists()


def test_reads_the_reference_through_gc_or_globals(kb_cache, problems):
    body = """
for obj in gc.get_objects():
    if type(obj).__name__ == "Model" and obj is not self:
        return obj(x)
ref = getattr(sys.modules.get("kb_reference"), "Model", None)
if ref is not None:
    return ref()(x)
for obj in gc.get_objects():
    if isinstance(obj, torch.Tensor) and obj is not x and obj.shape == x.shape:
        return obj.clone()
relu_ext.relu_forward(x)
return torch.empty_like(x)
"""
    code = candidate(body, prelude="import gc\nimport sys\n")
    assert not check_policy(code, "cpu", "lenient").ok
    r = run(kb_cache, problems[1], code)
    assert r.status == "incorrect", r.message


def test_harness_keeps_going_after_hostile_candidates(kb_cache, problems):
    import asyncio

    from .conftest import RELU_OK

    ev = KernelEvaluator(config(kb_cache, policy="off"))
    bad = candidate("ctypes.string_at(0)", prelude="import ctypes\n")
    items = [(problems[1], bad, 0), (problems[1], RELU_OK, 1), (problems[1], "not python (", 2)]
    out = asyncio.run(ev.aevaluate_many(items))
    assert [r.status for r in out] == ["runtime_error", "correct", "load_error"]
