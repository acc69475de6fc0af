"""A caller that runs one sandboxed ``report_then_spin`` and waits for it: the lifetime tests kill
this process (SIGKILL, SIGTERM) or stop it, and look at what is left of the sandbox.

    python sandbox_caller.py spawn|fork MARKER OUT WALL_S
"""

import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
sys.path.insert(0, HERE)

from closedloop.sandbox import SandboxLimits, run_sandboxed  # noqa: E402

mode, marker, out, wall_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
limits = SandboxLimits(wall_s=wall_s, cpu_s=None, writable_paths=[str(Path(marker).parent)],
                       python_path=[HERE] + sys.path)
res = run_sandboxed("sandbox_targets:report_then_spin", marker, out, limits=limits,
                    preload=["json"] if mode == "fork" else None)
print(res.status, flush=True)
