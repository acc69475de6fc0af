"""Part ``env``: what the machine is (GPU, driver, CUDA, the Python packages that matter, nvcc,
ncu) and, on a GPU, its two ceilings measured here: device-to-device copy bandwidth and the bf16
matrix-product rate on random data (METHOD.md: measure the ceilings, do not trust datasheets)."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys

from common import Recorder, cuda_ready, part_main
from report import table

PACKAGES = ("torch", "triton", "transformers", "trl", "accelerate", "tokenizers", "langgraph", "pydantic", "duckdb")


def _first_line(cmd: list[str]) -> str | None:
    """The last non-empty line a tool prints about its version (None when it is not here)."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def _ceilings() -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, medians of 10 timed runs after
    3 warm-ups, timed with CUDA events, on random data (zeros run faster on this hardware)."""
    import statistics

    import torch

    def timed(fn, n: int = 10) -> float:
        for _ in range(3):
            fn()
        ms = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(b))
        return statistics.median(ms)

    def copy() -> float:  # its 2 GiB are freed on return, before the matmul's operands
        src = torch.rand(1 << 28, device="cuda")  # 1 GiB
        dst = torch.empty_like(src)
        return timed(lambda: dst.copy_(src))

    copy_ms = copy()
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_ms = timed(lambda: a @ b)
    return {"copy_TBps": 2 * (1 << 30) / (copy_ms / 1e3) / 1e12, "bf16_matmul_TFLOPs": 2 * n ** 3 / (mm_ms / 1e3) / 1e12,
            "copy_ms": copy_ms, "matmul_8192_ms": mm_ms}


def run(rec: Recorder, args: argparse.Namespace) -> str:
    import torch

    info = {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "load": list(os.getloadavg()), "packages": _versions(),
            "torch_cuda": torch.version.cuda, "nvcc": _first_line(["nvcc", "--version"]),
            "ncu": _first_line(["ncu", "--version"]),
            "nvidia_smi": _first_line(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                                                     "clocks.mem", "--format=csv,noheader"])}
    rec.set("machine", info)
    ok, why = cuda_ready()
    rows = [["python", info["python"]], ["torch", f"{info['packages']['torch']} (CUDA {info['torch_cuda']})"],
            ["triton", info["packages"]["triton"]], ["transformers", info["packages"]["transformers"]],
            ["trl", info["packages"]["trl"]], ["nvcc", info["nvcc"]], ["ncu", info["ncu"]],
            ["nvidia-smi", info["nvidia_smi"]]]
    if ok:
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "capability": f"{props.major}.{props.minor}",
               "memory_GiB": round(props.total_memory / 2 ** 30, 1), "multiprocessors": props.multi_processor_count}
        rec.set("gpu", gpu)
        rows.insert(0, ["GPU", f"{gpu['name']} (sm_{props.major}{props.minor}, {gpu['multiprocessors']} SMs, "
                               f"{gpu['memory_GiB']} GiB)"])
        ceil = _ceilings()
        rec.set("ceilings", ceil)
        rows += [["copy (read + write)", f"{ceil['copy_TBps']:.2f} TB/s"],
                 ["bf16 matmul 8192^3", f"{ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s"]]
    else:
        rec.skip("gpu", why)
        rec.skip("ceilings", why)
    rec.summary(table(["", "here"], rows))
    return "ok"


if __name__ == "__main__":
    part_main("env", run)
