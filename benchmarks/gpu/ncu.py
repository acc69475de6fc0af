"""Nsight Compute (``ncu``) on one kernel of a Python program: the command, and its CSV read back.

``ncu --csv`` prints its details page as one row per metric: ``"ID","Process ID","Process
Name","Host Name","Kernel Name",...,"Section Name","Metric Name","Metric Unit","Metric Value"``
(the columns between vary across versions, so they are found by name). ``--print-units base``
keeps values in base units (``nsecond``, ``byte``, ``%``), and numbers may carry thousands
separators, which are dropped. ``--clock-control none`` leaves the GPU's clocks as they are
(the workplace's METHOD.md: never change the card's settings).
"""

from __future__ import annotations

import csv
import io
from typing import Any

#: What the profile agent reads: time, the speed-of-light percentages (is the kernel bound by
#: memory or by the SMs), bytes from DRAM, occupancy, and the launch's shape.
METRICS = ("gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
           "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes.sum",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
           "launch__block_size", "launch__grid_size")


def command(kernel_regex: str, csv_path: str, program: list[str], launch_skip: int = 0) -> list[str]:
    """``ncu`` profiling the first launch (after ``launch_skip``) of a kernel whose name matches."""
    return ["ncu", "--clock-control", "none", "--target-processes", "all", "--kernel-name", f"regex:{kernel_regex}",
            "--launch-skip", str(launch_skip), "--launch-count", "1", "--metrics", ",".join(METRICS), "--csv",
            "--print-units", "base", "--log-file", csv_path, *program]


def _number(text: str) -> float | str:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse(text: str) -> list[dict[str, Any]]:
    """The kernels in ``ncu --csv`` output, in launch order: ``{"id", "kernel", "metrics": {name:
    {"value", "unit"}}}``. Lines before the header (``==PROF==`` messages) are skipped."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header in the output (did the kernel name match any launch?)")
    rows = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    need = {"ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"}
    if not need <= set(rows.fieldnames or []):
        raise ValueError(f"ncu CSV lacks columns {sorted(need - set(rows.fieldnames or []))}")
    kernels: dict[str, dict[str, Any]] = {}
    for row in rows:
        k = kernels.setdefault(row["ID"], {"id": row["ID"], "kernel": row["Kernel Name"], "metrics": {}})
        k["metrics"][row["Metric Name"]] = {"value": _number(row["Metric Value"]), "unit": row["Metric Unit"]}
    return list(kernels.values())


def summarise(kernel: dict[str, Any]) -> dict[str, Any]:
    """The figures the profile agent reasons from, with the achieved DRAM bandwidth derived."""
    m = {name: v["value"] for name, v in kernel["metrics"].items()}
    ns = m.get("gpu__time_duration.sum")
    out: dict[str, Any] = {"kernel": kernel["kernel"], "duration_us": ns / 1e3 if isinstance(ns, float) else None,
                           "sm_throughput_pct": m.get("sm__throughput.avg.pct_of_peak_sustained_elapsed"),
                           "memory_throughput_pct": m.get(
                               "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
                           "dram_throughput_pct": m.get("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                           "dram_bytes": m.get("dram__bytes.sum"),
                           "achieved_occupancy_pct": m.get("sm__warps_active.avg.pct_of_peak_sustained_active"),
                           "registers_per_thread": m.get("launch__registers_per_thread"),
                           "block_size": m.get("launch__block_size"), "grid_size": m.get("launch__grid_size")}
    if isinstance(out["dram_bytes"], float) and out["duration_us"]:
        out["dram_TBps"] = out["dram_bytes"] / (out["duration_us"] * 1e-6) / 1e12
    return out
