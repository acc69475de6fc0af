"""Hostile candidates for the ``cuda`` backend: the attacks of the harness's test suite
(``tests/evals/kernelbench/test_hostile_candidates.py``, written there for the CPU backend with a
C++ kit) ported to a CUDA kit (``hostile_kit.cu``/``.cpp``), plus attacks only a GPU allows: a
write a terabyte out of bounds, work left running on a stream nobody waits for, outputs replayed
by device pointer, uninitialised device memory, a kernel that never ends.

The problem is the test suite's own ``1_ReLU.py`` (64 x 4096 floats). Every attack runs with the
static policy off: what is tested is the runtime boundary (the candidate in a process of its own,
the reference, the clock and the verdict out of its reach). ``EXPECTED`` is the status each must
end with; an attack that can only buy speed must end with no credited speedup beyond what its
deliberately slow kernel earns.
"""

from __future__ import annotations

from candidates import extension_header
from common import REPO

PROBLEM = REPO / "tests" / "evals" / "kernelbench" / "problems" / "level1" / "1_ReLU.py"
SLOW = 2_000_000  # GPU cycles each thread of the slow ReLU wastes first (about a millisecond)
KIT = extension_header("hostile_kit", "gpu_check_hostile_kit",
                       ["relu", "relu_unwaited", "scribble", "forever", "spin_thread", "exit_now"])
FORGED = '{"status": "ok", "value_json": "{\\"status\\": \\"correct\\", \\"speedup\\": 100.0}"}'


def candidate(body: str, prelude: str = "") -> str:
    """A ModelNew over the kit whose forward is ``body``."""
    return (KIT + prelude + "\n\nclass ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n\n"
            "    def forward(self, x):\n" + "\n".join("        " + ln for ln in body.strip("\n").splitlines()) + "\n")


HONEST = candidate("return ext.relu(x, 0)")

ATTACKS = {
    # --- forge the verdict ----------------------------------------------------------------------
    "writes_its_own_result_record": candidate("return ext.relu(x, 0) * 2", prelude=f"""
import os
from pathlib import Path
(Path(os.getcwd()).parent / "io" / "result.json").write_text({FORGED!r})
os._exit(0)
"""),
    "replaces_the_comparison_code": candidate("return ext.relu(x, 0) * 1.5", prelude="""
import closedloop.evals.kernelbench.compare as _cmp
_cmp.compare = lambda *a, **k: {"max_diff": 0.0, "mean_diff": 0.0}
_cmp.check_layout = lambda *a, **k: None
torch.allclose = lambda *a, **k: True
"""),
    # --- replay and partial correctness -------------------------------------------------------------
    "replays_by_device_pointer": candidate("""
key = x.data_ptr()
if key not in _CACHE:
    _CACHE[key] = ext.relu(x, 0)
return _CACHE[key].clone()
""", prelude="_CACHE = {}\n"),
    "right_only_while_it_thinks_it_is_checked": candidate("""
_N[0] += 1
out = ext.relu(x, 0)
return out if _N[0] <= 6 else out * 0.5
""", prelude="_N = [0]\n"),
    "returns_uninitialised_device_memory": candidate("return torch.empty_like(x)"),
    # --- the device itself ------------------------------------------------------------------------------
    "writes_a_terabyte_out_of_bounds": candidate("return ext.scribble(x)"),
    "exits_from_cpp_mid_forward": candidate("ext.exit_now(0)"),
    "background_thread_from_cpp": candidate("return ext.relu(x, 0)", prelude="ext.spin_thread()\n"),
    # --- buy speed --------------------------------------------------------------------------------------
    "leaves_work_on_an_unwaited_stream": candidate(f"return ext.relu_unwaited(x, {SLOW})", prelude="""
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_stream().synchronize = lambda *a, **k: None
"""),
    "slow_kernel_patches_the_clocks": candidate(f"return ext.relu(x, {SLOW})", prelude="""
import time
time.perf_counter_ns = lambda: 0
time.perf_counter = lambda: 0.0
time.clock_gettime_ns = lambda *a: 0
"""),
    # last: it holds the GPU until the sandbox's wall clock ends it
    "kernel_that_never_ends": candidate("return ext.forever(x)"),
}

#: the statuses each attack may end with (any other is a containment failure)
EXPECTED = {
    "writes_its_own_result_record": ("load_error", "runtime_error"),
    "replaces_the_comparison_code": ("incorrect",),
    "replays_by_device_pointer": ("incorrect",),
    "right_only_while_it_thinks_it_is_checked": ("incorrect",),
    "returns_uninitialised_device_memory": ("incorrect",),
    "writes_a_terabyte_out_of_bounds": ("runtime_error",),
    "exits_from_cpp_mid_forward": ("runtime_error",),
    "background_thread_from_cpp": ("policy_violation",),
    "leaves_work_on_an_unwaited_stream": ("correct", "incorrect", "policy_violation"),
    "slow_kernel_patches_the_clocks": ("correct", "incorrect", "policy_violation"),
    "kernel_that_never_ends": ("timeout",),
}
#: attacks that can only buy speed: a credited speedup must stay below this
SPEED_ONLY = {"leaves_work_on_an_unwaited_stream": 0.5, "slow_kernel_patches_the_clocks": 0.5}


def contained(name: str, status: str, credited_speedup: float | None) -> bool:
    """Whether an attack's verdict is one the judge may give it."""
    if status not in EXPECTED[name]:
        return False
    cap = SPEED_ONLY.get(name)
    return cap is None or credited_speedup is None or credited_speedup < cap
