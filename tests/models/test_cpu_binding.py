"""CPU binding of ``closedloop serve``'s engine process: how the CPUs are split, and that binding a
process reaches the threads it already runs and the ones it starts later."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from closedloop.models.cpu_binding import split_cpus


def test_the_engine_gets_the_last_cpus_and_the_server_the_rest():
    assert split_cpus(None, [0, 1]) == ([1], [0])
    assert split_cpus(None, [0, 2, 4, 6]) == ([2, 4, 6], [0])  # default: all but one for the engine
    assert split_cpus(2, [0, 1, 2, 3]) == ([2, 3], [0, 1])
    assert split_cpus(1, [5]) is None  # one CPU: nothing to split
    assert split_cpus(4, [0, 1, 2, 3]) is None  # the engine would take them all: no binding
    assert split_cpus(0, [0, 1]) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_binding_reaches_running_and_later_threads():
    cpu = sorted(os.sched_getaffinity(0))[0]
    code = textwrap.dedent(f"""
        import os, threading
        from closedloop.models.cpu_binding import bind_this_process
        started, stop = threading.Event(), threading.Event()
        def wait():
            started.set()
            stop.wait()
        before = threading.Thread(target=wait)
        before.start()
        started.wait()
        bind_this_process([{cpu}])
        after = threading.Thread(target=stop.wait)
        after.start()
        seen = [os.sched_getaffinity(t.native_id) for t in (before, after)] + [os.sched_getaffinity(0)]
        stop.set()
        print(all(s == {{{cpu}}} for s in seen))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
