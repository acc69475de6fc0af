"""Part ``egg_profile``: EGG's profile step (``graphs/egg.py``, ``_Agents.plan``) fed by Nsight
Compute on one kernel, returning the ``{bottleneck, modification_plan}`` the profile agent must
answer (validated by ``agents/kernel/profile.parse_profile_plan``).

The kernel: the shipped CUDA GELU (problem 88) from the kernelbench part's build, or the Triton
GELU when that build is not there. ``ncu`` profiles its first launch inside
``kernel_timing.py`` (``ncu.py``: the command and the CSV); the figures become the
``profile_kernel`` report the profile agent reads, and the step runs as the graph runs it:
prompt, reply, parse, re-ask. The reply comes from a rule over the report (``plan_from_report``)
standing in for the profile model: the device machine reaches no trained model, and what is
checked is the path from the profiler to a valid plan, not a model's judgement.

A dry run (no GPU, no ncu) feeds the same step torch's CPU profiler (the report ``profile_kernel``
gives on the cpu backend) and records why ncu did not run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
from typing import Any

import ncu
from common import HERE, SHIPPED, Recorder, cuda_ready, part_main
from report import table

sys.path.insert(0, str(SHIPPED))
import candidates  # noqa: E402

PROBLEM_ID = 88
STEP = "memory"


def plan_from_report(report: str) -> dict[str, Any]:
    """The stand-in profile agent: one bottleneck and a plan read off the profiler's figures."""
    data = json.loads(report)
    prof = data.get("profile", {})
    n = prof.get("ncu")
    if not n:
        top = (prof.get("rows") or [{}])[0]
        return {"bottleneck": f"no hardware counters here; the heaviest operator is {top.get('op', 'unknown')} "
                              f"({top.get('self_cpu_ms', 0):.3g} ms per forward)",
                "modification_plan": ["measure on a GPU with Nsight Compute before tuning the memory path"]}
    dram, sm, occ = (n.get("dram_throughput_pct") or 0.0, n.get("sm_throughput_pct") or 0.0,
                     n.get("achieved_occupancy_pct") or 0.0)
    if dram >= 60 and dram >= sm:
        return {"bottleneck": f"memory-bound: DRAM at {dram:.0f}% of peak ({n.get('dram_TBps', 0):.2f} TB/s) while "
                              f"the SMs are at {sm:.0f}%",
                "modification_plan": ["keep one read and one write per element (no extra pass over the tensor)",
                                      "16-byte vector loads and stores, coalesced across each warp",
                                      "a grid of a few waves per SM with a grid-stride loop"]}
    if sm >= 60:
        return {"bottleneck": f"compute-bound: SMs at {sm:.0f}% of peak, DRAM at {dram:.0f}%",
                "modification_plan": ["cheaper transcendental math (a hardware tanh approximation within tolerance)",
                                      "fewer instructions per element (hoist constants, fuse multiplies into FMAs)"]}
    return {"bottleneck": f"latency-bound: SMs at {sm:.0f}% and DRAM at {dram:.0f}% of peak, "
                          f"occupancy {occ:.0f}%",
            "modification_plan": ["more independent loads in flight per thread before their first use",
                                  "more warps per SM (smaller blocks or fewer registers)"]}


def _report_from_prompt(prompt: str) -> str:
    m = re.search(r"Profiler report:\n```\n(.*?)\n```", prompt, re.S)
    return m.group(1) if m else "{}"


async def profile_step(code: str, report: str, backend: str) -> dict[str, Any]:
    """EGG's profile step on ``code`` with ``report`` as ``profile_kernel``'s answer."""
    from closedloop.agents.kernel.paradigms import TUNING_GUIDES
    from closedloop.graphs.egg import EggContext, _Agents, _Log
    from closedloop.messages import AssistantMessage
    from closedloop.models.scripted import ScriptedClient
    from closedloop.tool import Tool, ToolRegistry

    async def profile_kernel(code: str) -> str:
        """The profiler's report for a candidate (Nsight Compute's figures on a GPU)."""
        return report

    async def evaluate_kernel(code: str) -> str:
        """Required by the graph's context; the profile step never calls it."""
        raise RuntimeError("evaluate_kernel is not part of the profile step")

    client = ScriptedClient(lambda messages: AssistantMessage(
        content=json.dumps(plan_from_report(_report_from_prompt(messages[-1].content)))))
    tools = ToolRegistry()
    tools.register(Tool(profile_kernel))
    tools.register(Tool(evaluate_kernel))
    ctx = EggContext(client=client, tools=tools, backend=backend)
    agents = _Agents(ctx, _Log(0))
    plan, reasks = await agents.plan(code, STEP, TUNING_GUIDES[backend][STEP])
    prompt = client.calls[0][-1].content if client.calls else ""
    return {"plan": plan.model_dump() if plan else None, "reasks": reasks,
            "report_reached_the_prompt": json.loads(report)["profile"].get("tool", "?") in prompt,
            "turns": len(agents.log.turns),
            "tool_records": len(agents.log.records)}


def _ncu_report(rec: Recorder, args: argparse.Namespace) -> tuple[str, str, str] | None:
    """(report, code, backend) from ncu on the shipped GELU, or None when ncu gave nothing."""
    ext = args.work / f"extensions_{PROBLEM_ID}.json"
    cand = args.work / f"{PROBLEM_ID}_cuda.py"
    if ext.is_file() and cand.is_file():
        code, backend, extra = cand.read_text(), "cuda", ["--extensions", str(ext)]
    else:
        rec.note("the kernelbench part left no built CUDA GELU: profiling the Triton GELU instead")
        cand = SHIPPED / "triton" / f"{candidates.KERNEL_PROBLEMS[PROBLEM_ID]}.py"
        code, backend, extra = cand.read_text(), "triton", []
    csv_path = args.work / "ncu.csv"
    program = [sys.executable, str(HERE / "kernel_timing.py"), "--problem", str(candidates.problem_file(PROBLEM_ID)),
               "--candidate", str(cand), "--out", str(args.work / "ncu_target.json"), "--trials", "1", *extra]
    cmd = ncu.command("gelu_tanh", str(csv_path), program)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(5.0, rec.remaining() - 10))
    rec.set("ncu_command", " ".join(cmd[:cmd.index("--metrics")]) + " ... " + " ".join(program[1:2]))
    text = csv_path.read_text() if csv_path.is_file() else ""
    try:
        kernels = ncu.parse(text)
    except ValueError as exc:
        rec.set("ncu_error", {"error": str(exc), "exit_code": proc.returncode, "output": (proc.stdout + proc.stderr)[-2000:],
                              "csv_head": text[:1000]})
        return None
    figures = ncu.summarise(kernels[0])
    rec.set("ncu", figures)
    report = json.dumps({"status": "correct", "profile": {"tool": "Nsight Compute (ncu)", "ncu": figures}}, indent=1)
    return report, code, backend


def _cpu_report() -> tuple[str, str, str]:
    """The cpu backend's kind of report: torch's profiler on the problem's Model, small inputs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from closedloop.evals.kernelbench.problems import scale_source

    mod: dict[str, Any] = {}
    exec(compile(scale_source(candidates.problem_file(PROBLEM_ID).read_text(), 1 / 64)[0], "problem", "exec"), mod)
    model, inputs = mod["Model"](), mod["get_inputs"]()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            model(*inputs)
    rows = [{"op": ev.key, "calls": ev.count, "self_cpu_ms": ev.self_cpu_time_total / 1e3 / 3}
            for ev in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]]
    report = json.dumps({"status": "correct", "profile": {"tool": "torch.profiler (cpu)", "rows": rows}}, indent=1)
    return report, candidates.triton_candidate(PROBLEM_ID), "triton"


def run(rec: Recorder, args: argparse.Namespace) -> str:
    ok, why = cuda_ready()
    found = None
    if not ok:
        rec.skip("ncu", f"{why}: no hardware counters to read")
    elif shutil.which("ncu") is None:
        rec.skip("ncu", "ncu is not installed here")
    else:
        found = _ncu_report(rec, args)
    if found is None:
        report, code, backend = _cpu_report() if not ok else (json.dumps({"status": "correct", "profile": {
            "tool": "none (ncu gave no figures)"}}), candidates.triton_candidate(PROBLEM_ID), "triton")
        rec.set("profiler", "torch.profiler (cpu)" if not ok else "none (ncu failed)")
    else:
        report, code, backend = found
        rec.set("profiler", "Nsight Compute")
    step = asyncio.run(profile_step(code, report, backend))
    rec.set("profile_step", step)
    plan = step["plan"]
    n = rec.data["results"].get("ncu") or {}
    rec.summary(table(["kernel", "duration us", "DRAM %", "SM %", "occupancy %", "TB/s"],
                      [[n.get("kernel"), n.get("duration_us"), n.get("dram_throughput_pct"), n.get("sm_throughput_pct"),
                        n.get("achieved_occupancy_pct"), n.get("dram_TBps")]]) + [
        "", f"Profile step ({rec.data['results']['profiler']}): "
            + (f"bottleneck: {plan['bottleneck']}; plan: {'; '.join(plan['modification_plan'])}" if plan else "no plan"),
        f"(re-asks {step['reasks']}; the report reached the prompt: {step['report_reached_the_prompt']})"])
    good = plan is not None and step["report_reached_the_prompt"] and (not ok or found is not None)
    return "ok" if good else "failed"


if __name__ == "__main__":
    part_main("egg_profile", run)
