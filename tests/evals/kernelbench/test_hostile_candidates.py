"""Attacks on the judge, each written as a candidate in KernelBench's ModelNew format (issue 25).

Every attack runs with the static policy OFF (the runtime boundary is what is tested: the
candidate in a process of its own, the reference and the verdict out of its reach) and ends with a
non-correct status, or, where the attack can only buy speed, with no speedup beyond what its
(deliberately slow) kernel earns. After each one, an honest candidate evaluated with the same
cache and fork server is still correct. The policy's own verdict on each attack is checked
separately (it is a first filter: ``test_policy_flags_each_attack``).

Native attacks use one shared C++ extension (``conftest.KIT``: process creation, file writes,
``_exit``, forks, threads, raw writes to the channel), built once per session.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import tempfile
import uuid
from pathlib import Path

import pytest

from closedloop.evals.kernelbench.evaluate import KernelEvaluator
from closedloop.evals.kernelbench.policy import check_policy

from .conftest import KERNEL, KIT, PLANTED_KEY, RELU_OK, config

SLOW = 1_000_000  # iterations wasted per call by the kit's slow (but correct) ReLU: ~1-5 ms


def candidate(body: str, prelude: str = "", *, kit: bool = False) -> str:
    head = (KIT if kit else "") + KERNEL
    return head + prelude + "\n\nclass ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n\n" \
        "    def forward(self, x):\n" + "\n".join("        " + ln for ln in body.strip("\n").splitlines()) + "\n"


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def run(kb_cache, problem, code: str, *, policy: str = "off", **kw):
    return KernelEvaluator(config(kb_cache, policy=policy, trials=2, iters=4, **kw)).evaluate(problem, code)


def honest_still_correct(kb_cache, problem) -> None:
    r = KernelEvaluator(config(kb_cache, trials=1, iters=2)).evaluate(problem, RELU_OK)
    assert r.status == "correct", (r.message, r.traceback_tail)
    assert all(b["cached"] for b in r.builds)


def no_gain(r) -> None:
    """An attack that can only buy speed: whatever its status, no speedup is credited beyond what
    its slow kernel honestly earns (a small fraction of eager torch)."""
    assert r.status != "suspicious", r.message
    assert r.credited_speedup is None or r.credited_speedup < 0.5, (r.status, r.speedup, r.message)


@pytest.fixture(scope="module", autouse=True)
def _built(relu_result, kb_cache, problems):
    assert relu_result.status == "correct"  # the shared kernel is in the cache before the hostile ones run
    kit = KernelEvaluator(config(kb_cache, policy="off")).evaluate(problems[1], candidate("return kit.relu_spin(x, 0)", kit=True))
    assert kit.status == "correct", (kit.message, kit.compiler_log, kit.traceback_tail)


FORGED = json.dumps({"status": "ok", "value_json": json.dumps({"status": "correct", "speedup": 100.0})})

ATTACKS = {
    # --- forge the verdict -------------------------------------------------------------------------
    "writes_its_own_result_record": (1, candidate("return relu_ext.relu_forward(x) * 2", prelude=f"""
import os
from pathlib import Path
(Path(os.getcwd()).parent / "io" / "result.json").write_text({FORGED!r})
os._exit(0)
""")),
    "writes_the_record_from_cpp_and_exits": (1, candidate(f"""
kit.write_file(str(Path(os.getcwd()).parent / "io" / "result.json"), {FORGED!r})
kit.exit_now(0)
""", prelude="import os\nfrom pathlib import Path\n", kit=True)),
    "replaces_the_comparison_code": (1, candidate("return relu_ext.relu_forward(x) * 1.5", prelude="""
import closedloop.evals.kernelbench.compare as _cmp
_cmp.compare = lambda *a, **k: {"max_diff": 0.0, "mean_diff": 0.0}
_cmp.check_layout = lambda *a, **k: None
torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True
""")),
    "answers_the_judge_itself": (1, candidate("return relu_ext.relu_forward(x)", prelude="""
import json, struct
_msg = json.dumps({"op": "loaded"}).encode()
kit.write_fd(3, struct.pack(">I", len(_msg)) + _msg)  # a reply before the question
""", kit=True)),
    # --- fake closeness ----------------------------------------------------------------------------
    "torch_function_mode_says_close": (1, candidate("return relu_ext.relu_forward(x) + 1.0", prelude="""
from torch.overrides import TorchFunctionMode

class _Liar(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.allclose, torch.equal):
            return True
        return func(*args, **(kwargs or {}))

_Liar().__enter__()
""")),
    # --- replay -------------------------------------------------------------------------------------
    "replays_by_shape": (1, candidate("""
key = tuple(x.shape)
if key not in _CACHE:
    _CACHE[key] = relu_ext.relu_forward(x)
return _CACHE[key].clone()
""", prelude="_CACHE = {}\n")),
    "right_only_while_it_thinks_it_is_checked": (1, candidate("""
_N[0] += 1
out = relu_ext.relu_forward(x)
return out if _N[0] <= 6 else out * 0.5
""", prelude="_N = [0]\n")),
    # --- libc, processes, files, exits ---------------------------------------------------------------
    "libc_system_through_numpy_ctypeslib": (1, candidate("""
np.ctypeslib.ctypes.CDLL(None).system(b"sleep 60 &")
return relu_ext.relu_forward(x)
""", prelude="import numpy as np\n")),
    "libc_exit_through_ctypes": (1, candidate("ctypes.CDLL(None)._exit(0)", prelude="import ctypes\n")),
    "posix_spawn_from_cpp": (1, candidate("kit.spawn('sleep 60')\nreturn relu_ext.relu_forward(x)", kit=True)),
    "forks_a_helper_from_cpp": (1, candidate("kit.fork_sleeper()\nreturn relu_ext.relu_forward(x)", kit=True)),
    "exits_from_cpp_mid_forward": (1, candidate("kit.exit_now(0)", kit=True)),
    "more_openmp_threads_than_allowed": (1, candidate("return kit.relu_threads(x, 4)", kit=True)),
    "background_thread_from_cpp": (1, candidate("return relu_ext.relu_forward(x)", prelude="kit.spin_thread()\n",
                                                kit=True)),
    "reads_other_sandboxes_arenas": (1, candidate("""
me = int(os.readlink("/proc/self"))
leaks = []
for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != me]:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            if "kernelbench-arena" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                with open(f"/proc/{pid}/fd/{fd}", "rb") as fh:
                    fh.read(16)
                leaks.append(pid)
        except OSError:
            pass
if leaks:
    raise RuntimeError(f"LEAKED arenas of {leaks}")
return torch.zeros_like(x)
""", prelude="import os\n")),
    # --- crash the parent ------------------------------------------------------------------------------
    "returns_a_deeply_nested_output": (1, candidate("""
out = relu_ext.relu_forward(x)
for _ in range(100_000):
    out = [out]
return out
""")),
    "sends_deeply_nested_json": (1, candidate(f"""
os.write(3, {frame(b'{"op": "done", "x": ' + b'[' * 200_000 + b']' * 200_000 + b'}')!r})
return relu_ext.relu_forward(x)
""", prelude="import os\n")),
    "sends_a_huge_frame_length": (1, candidate("os.write(3, b'\\xff\\xff\\xff\\xf0' + b'{')\nreturn relu_ext.relu_forward(x)",
                                               prelude="import os\n")),
    "forges_a_nested_result_record_and_exits": (1, candidate("""
(Path(os.getcwd()).parent / "io" / "result.json").write_text("[" * 200_000 + "]" * 200_000)
os._exit(0)
""", prelude="import os\nfrom pathlib import Path\n")),
    # --- the classics: aliases, in-place, uninitialised memory, a non-tensor ---------------------------------
    "returns_its_input": (3, candidate("relu_ext.relu_forward(x)\nreturn x")),
    "zeroes_its_inputs": (1, candidate("out = torch.zeros_like(x)\nrelu_ext.relu_forward(x)\nx.zero_()\nreturn out")),
    "returns_torch_empty": (1, candidate("return torch.empty_like(x)")),  # hoping for a freed reference output
    "returns_a_non_tensor": (1, candidate("return {'out': relu_ext.relu_forward(x)}")),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_fails_with_the_policy_off(name, kb_cache, problems):
    pid, code = ATTACKS[name]
    r = run(kb_cache, problems[pid], code)
    assert r.status not in ("correct", "suspicious"), (name, r.status, r.message)
    assert r.speedup is None and r.credited_speedup is None
    expected = {
        # the build step ran it too: its forged record there hid the extension it needs, so it
        # cannot even load (and where it loads, it dies before answering)
        "writes_its_own_result_record": ("load_error", "runtime_error"),
        "writes_the_record_from_cpp_and_exits": ("runtime_error",),
        "replaces_the_comparison_code": ("incorrect",), "answers_the_judge_itself": ("invalid_output",),
        "torch_function_mode_says_close": ("incorrect",), "replays_by_shape": ("incorrect",),
        "right_only_while_it_thinks_it_is_checked": ("incorrect",),
        "libc_system_through_numpy_ctypeslib": ("policy_violation",), "libc_exit_through_ctypes": ("runtime_error",),
        "posix_spawn_from_cpp": ("policy_violation",), "forks_a_helper_from_cpp": ("policy_violation",),
        "exits_from_cpp_mid_forward": ("runtime_error",), "more_openmp_threads_than_allowed": ("policy_violation",),
        "background_thread_from_cpp": ("policy_violation",), "reads_other_sandboxes_arenas": ("incorrect",),
        "returns_a_deeply_nested_output": ("shape_mismatch",), "sends_deeply_nested_json": ("invalid_output",),
        "sends_a_huge_frame_length": ("invalid_output",), "forges_a_nested_result_record_and_exits": ("runtime_error",),
        "returns_its_input": ("incorrect",), "zeroes_its_inputs": ("incorrect",), "returns_torch_empty": ("incorrect",),
        "returns_a_non_tensor": ("incorrect", "shape_mismatch"),
    }[name]
    assert r.status in expected, (name, r.status, r.message)
    if name == "reads_other_sandboxes_arenas":
        assert "LEAKED" not in r.message
    if name == "returns_its_input":
        assert "aliases input" in r.message or "differs" in r.message
    honest_still_correct(kb_cache, problems[1])


# Attacks that can only buy speed: the kernel is correct but slow, and the attack would make it
# look fast (slow the reference down, replay cached outputs, do the work where it is not timed,
# or patch the clocks). Correct is then the right verdict; a speedup is not.
SPEED_ATTACKS = {
    "slows_the_reference_with_hooks_and_patched_ops": candidate(f"return kit.relu_spin(x, {SLOW})", prelude="""
import time
import torch.nn.modules.module as _module
_module.register_module_forward_hook(lambda mod, inp, out: time.sleep(0.0005))
_slow = torch.relu
torch.relu = lambda t: _slow(t.clone().clone().clone())
""", kit=True),
    "replays_outputs_keyed_on_sampled_values": candidate(f"""
flat = x.reshape(-1)
key = (tuple(x.shape), float(flat[0]), float(flat[-1]), float(flat[flat.numel() // 2]))
if key not in _CACHE:
    _CACHE[key] = kit.relu_spin(x, {SLOW})
return _CACHE[key].clone()
""", prelude="_CACHE = {}\n", kit=True),
    "works_in_collect_instead_of_forward": candidate("return x", prelude=f"""
import sys
_srv = sys.modules["closedloop.evals.kernelbench.serve"]
_handlers = _srv._ROLES["candidate"]
_collect = _handlers["collect"]

def _go(self, msg, fds):
    self.outs = [None] * int(msg["n"])
    return {{"op": "done"}}

def _late(self, msg, fds):
    self.outs = [kit.relu_spin(args[0], {SLOW}) for args in self.slots[:len(self.outs)]]
    return _collect(self, msg, fds)

_handlers["go"], _handlers["collect"] = _go, _late
""", kit=True),
    "patches_the_clocks": candidate(f"return kit.relu_spin(x, {SLOW})", prelude="""
import time
time.perf_counter_ns = lambda: 0
time.perf_counter = lambda: 0.0
time.clock_gettime_ns = lambda *a: 0
""", kit=True),
}


@pytest.mark.parametrize("name", sorted(SPEED_ATTACKS))
def test_speed_attack_buys_no_speedup(name, kb_cache, problems):
    r = run(kb_cache, problems[1], SPEED_ATTACKS[name])
    assert r.status in ("correct", "incorrect", "policy_violation"), (name, r.status, r.message)
    no_gain(r)
    if r.status == "correct" and not r.timing_unstable:
        assert r.speedup is not None and r.speedup < 0.5, (name, r.speedup, r.message)
    honest_still_correct(kb_cache, problems[1])


def test_busy_while_it_is_not_its_turn(kb_cache, problems):
    """Spinning between requests (it could slow the reference down, or precompute): the CPU it
    spends outside its turns is read from the kernel's account, not from anything it says."""
    code = candidate("return relu_ext.relu_forward(x)", prelude="""
import socket, sys
_wire = sys.modules["closedloop.evals.kernelbench.wire"]
_recv = _wire.recv

def _busy(sock, **kw):
    sock.setblocking(False)
    while True:
        try:
            sock.recv(1, socket.MSG_PEEK)
            break
        except BlockingIOError:
            pass
    sock.setblocking(True)
    return _recv(sock, **kw)

_wire.recv = _busy
""")
    r = run(kb_cache, problems[1], code)
    assert r.status == "policy_violation" and "not its turn" in r.message, (r.status, r.message)
    honest_still_correct(kb_cache, problems[1])


def test_poisoning_the_build_cache(kb_cache, problems):
    """A candidate overwrites every library in the cache (and its hash record) with its own: it
    cannot write there, and the honest candidate after it loads its own, verified build."""
    before = {p: p.read_bytes() for p in kb_cache.glob("*/*.so")}
    assert before
    code = candidate(f"""
for key in os.listdir({str(kb_cache)!r}):
    d = os.path.join({str(kb_cache)!r}, key)
    for f in os.listdir(d) if os.path.isdir(d) else []:
        if f.endswith(".so"):
            data = b"not a library"
            with open(os.path.join(d, f), "wb") as fh:
                fh.write(data)
            with open(os.path.join(d, "artifact.json"), "w") as fh:
                fh.write(json.dumps({{"file": f, "sha256": hashlib.sha256(data).hexdigest()}}))
return relu_ext.relu_forward(x)
""", prelude="import hashlib, json, os\n")
    r = run(kb_cache, problems[1], code)
    if not r.sandbox.get("enforced", {}).get("filesystem"):
        pytest.skip("Landlock unavailable here: the cache is only as safe as the user's files")
    assert r.status == "runtime_error" and "PermissionError" in r.message, (r.status, r.message)
    assert {p: p.read_bytes() for p in kb_cache.glob("*/*.so")} == before
    honest_still_correct(kb_cache, problems[1])


def test_the_builder_publishes_only_what_it_was_asked_to_build(kb_cache):
    """The kit's static initializer ran in the trusted builder (when the module fixture built it)
    and planted a library for a key nobody asked for, and tried to write outside its staging
    directory: neither reached anything."""
    assert not (kb_cache / PLANTED_KEY).exists()
    assert not (Path(tempfile.gettempdir()) / "closedloop-kit-escaped").exists()


def test_writes_outside_and_network_are_contained(kb_cache, problems):
    target = Path(tempfile.gettempdir()) / f"closedloop-escape-{uuid.uuid4().hex}"
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    code = candidate(f"""
kit.write_file({str(target)!r}, "pwned")
try_socket = socket.socket()
try_socket.settimeout(2)
try_socket.connect(("127.0.0.1", {srv.getsockname()[1]}))
return relu_ext.relu_forward(x)
""", prelude="import socket\n", kit=True)
    try:
        r = run(kb_cache, problems[1], code)
        with pytest.raises(OSError):
            srv.accept()  # nothing reached us
    finally:
        srv.close()
    assert not target.exists()
    if r.sandbox.get("enforced", {}).get("network"):
        assert r.status == "runtime_error", (r.status, r.message)


def test_infinite_loop_segfault_and_memory(kb_cache, problems):
    lim = config(kb_cache).limits.model_copy(update={"cpu_s": 4, "wall_s": 40})
    assert run(kb_cache, problems[1], candidate("while True:\n    pass"), limits=lim).status == "timeout"
    seg = run(kb_cache, problems[1], candidate("ctypes.string_at(0)", prelude="import ctypes\n"))
    assert seg.status == "runtime_error" and "crash" in seg.message, seg.message
    mem = run(kb_cache, problems[1], candidate("hoard = []\nwhile True:\n    hoard.append(torch.ones(1 << 26))"))
    assert mem.status == "runtime_error", mem.message


def test_the_batch_goes_on_after_hostile_candidates(kb_cache, problems):
    """``aevaluate_many`` gives every item a verdict, in order, whatever the ones before did."""
    ev = KernelEvaluator(config(kb_cache, policy="off", trials=1, iters=2))
    items = [(problems[1], ATTACKS["sends_deeply_nested_json"][1], 0), (problems[1], RELU_OK, 1),
             (problems[1], "not python (", 2), (problems[1], ATTACKS["writes_its_own_result_record"][1], 3),
             (problems[1], RELU_OK, 4)]
    out = asyncio.run(ev.aevaluate_many(items))
    assert [r.status for r in out][:3] == ["invalid_output", "correct", "load_error"]
    assert out[3].status in ("load_error", "runtime_error") and out[4].status == "correct"
    assert [r.sample_id for r in out] == [0, 1, 2, 3, 4]


def test_policy_flags_each_attack():
    """The static policy is a first filter: every attack above is refused before it runs (lenient
    mode), by the rule that names what it does."""
    rules = {
        "writes_its_own_result_record": "forbidden_import", "writes_the_record_from_cpp_and_exits": "cpp_file",
        "replaces_the_comparison_code": "forbidden_import", "answers_the_judge_itself": "cpp_raw",
        "torch_function_mode_says_close": "forbidden_import", "libc_system_through_numpy_ctypeslib": "forbidden_attribute",
        "libc_exit_through_ctypes": "forbidden_import", "posix_spawn_from_cpp": "cpp_process",
        "forks_a_helper_from_cpp": "cpp_process", "exits_from_cpp_mid_forward": "cpp_exit",
        "more_openmp_threads_than_allowed": "cpp_threads", "background_thread_from_cpp": "cpp_threads",
        "reads_other_sandboxes_arenas": "forbidden_import", "sends_deeply_nested_json": "forbidden_import",
        "sends_a_huge_frame_length": "forbidden_import", "forges_a_nested_result_record_and_exits": "forbidden_import",
    }
    for name, rule in rules.items():
        rep = check_policy(ATTACKS[name][1], "cpu", "lenient")
        assert rule in {v.rule for v in rep.violations}, (name, rep.summary())
    for name, code in SPEED_ATTACKS.items():
        assert not check_policy(code, "cpu", "lenient").ok, name
    # the ones that are only wrong (no trick the policy can see) are left to the judge
    for name in ("returns_its_input", "returns_torch_empty"):
        assert check_policy(ATTACKS[name][1], "cpu", "strict").ok, name


def test_policy_on_refuses_before_running(kb_cache, problems):
    r = run(kb_cache, problems[1], ATTACKS["torch_function_mode_says_close"][1], policy="strict")
    assert r.status == "policy_violation" and r.sandbox == {}


def test_env_for_sandboxes_scrubs_secrets(kb_cache, problems, monkeypatch):
    monkeypatch.setenv("CLOSEDLOOP_SECRET_TOKEN", "hunter2")
    r = run(kb_cache, problems[1], candidate("""
if "CLOSEDLOOP_SECRET_TOKEN" in os.environ:
    return relu_ext.relu_forward(x) * 2
return relu_ext.relu_forward(x)
""", prelude="import os\n"))
    assert r.status == "correct", r.message
