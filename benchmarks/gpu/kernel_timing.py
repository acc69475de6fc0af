"""One shipped kernel against its problem's ``Model``, outside the judge: correct on fresh inputs,
and timed on the device.

    python kernel_timing.py --problem P.py --candidate C.py --out R.json [--timer events|do_bench]
                            [--extensions E.json] [--scale S] [--device cpu]

Why beside the judge: the judge's clock (``evals/kernelbench/judge.py``) times each call with its
fresh inputs' copy to the device and the outputs' copy back, since every call's inputs are new;
KernelBench times the forward alone on inputs already on the device. This script gives the
kernel's own time, as KernelBench does (``timing.time_execution_with_cuda_event``: 3 warm-ups,
the L2 cache overwritten before each trial, CUDA events around the forward, the first trial
dropped), or with ``triton.testing.do_bench`` (median) for Triton. Both are reported beside the
judge's verdict. Our own kernels only run here (trusted code: no sandbox), in a process of
their own. ``--extensions`` loads the very libraries the judge's build step made (the judge's
own loader), so what is timed is what was judged. On a CPU (``--device cpu``, Triton under its
interpreter) only correctness is checked.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import types
from pathlib import Path
from typing import Any

ATOL = RTOL = 1e-2  # KernelBench v0.1's tolerance, as the judge's default
CHECKS = 3


def load_module(name: str, path: Path, code: str | None = None) -> types.ModuleType:
    """A module from a file (Triton's JIT reads its kernels' source from the file)."""
    if code is not None:
        path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def events_ms(fn: Any, trials: int) -> list[float]:
    """KernelBench's ``time_execution_with_cuda_event``: warm-ups, then per trial a 256 MB write
    that evicts the L2 cache, CUDA events around the call, the first trial dropped."""
    import torch

    for _ in range(3):
        fn()
        torch.cuda.synchronize()
    out = []
    for _ in range(trials + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush = torch.empty((32, 1024, 1024), dtype=torch.int64, device="cuda")
        flush.fill_(42)
        del flush
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out[1:]


def do_bench_ms(fn: Any) -> list[float]:
    import triton.testing

    return [float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from closedloop.evals.kernelbench.problems import scale_source

    if args.extensions:
        from closedloop.evals.kernelbench import serve

        spec = json.loads(Path(args.extensions).read_text())
        serve._install_prebuilt(spec["extensions"], spec["settings"])
    code, scaled = scale_source(Path(args.problem).read_text(), args.scale)
    work, tag = Path(args.out).parent, Path(args.candidate).stem.split("_")[0]
    problem = load_module(f"kb_problem_{tag}", work / f"timing_problem_{tag}.py", code)
    candidate = load_module(f"kb_candidate_{tag}", work / f"timing_candidate_{tag}.py", Path(args.candidate).read_text())
    device = args.device
    torch.manual_seed(42)
    init = list(problem.get_init_inputs())
    torch.manual_seed(42)
    ref = problem.Model(*init).to(device)
    torch.manual_seed(42)
    new = candidate.ModelNew(*init).to(device)
    result: dict[str, Any] = {"device": device, "scale": args.scale, "scaled_constants": scaled, "checks": []}
    with torch.no_grad():
        for seed in range(CHECKS):
            torch.manual_seed(1000 + seed)
            inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in problem.get_inputs()]
            want, got = ref(*inputs), new(*inputs)
            ok = (got.shape == want.shape and got.dtype == want.dtype
                  and bool(torch.allclose(got, want, atol=ATOL, rtol=RTOL)))
            diff = float((got.float() - want.float()).abs().max()) if got.shape == want.shape else None
            result["checks"].append({"seed": 1000 + seed, "correct": ok, "max_diff": diff})
        result["correct"] = all(c["correct"] for c in result["checks"])
        if device == "cpu" or not result["correct"]:
            return result
        timer = {"events": lambda fn: events_ms(fn, args.trials), "do_bench": do_bench_ms}[args.timer]
        ref_ms, new_ms = timer(lambda: ref(*inputs)), timer(lambda: new(*inputs))
    result.update(timer=args.timer, reference_ms=statistics.median(ref_ms), candidate_ms=statistics.median(new_ms),
                  reference_ms_mean=statistics.fmean(ref_ms), candidate_ms_mean=statistics.fmean(new_ms),
                  trials=len(ref_ms), speedup=statistics.median(ref_ms) / statistics.median(new_ms))
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problem", required=True)
    p.add_argument("--candidate", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timer", choices=["events", "do_bench"], default="events")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--extensions", help="JSON {extensions: {key: library}, settings: {...}} from the judge's build")
    p.add_argument("--scale", type=float, default=1.0, help="the problem's sizes scaled as the harness does")
    p.add_argument("--device", default="cuda")
    return p


def main() -> None:
    args = parser().parse_args()
    Path(args.out).write_text(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    main()
