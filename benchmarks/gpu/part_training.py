"""Part ``training``: SFT tokens/s and GRPO seconds per step at Qwen2-0.5B's shape (the model
part's random-weight checkpoint), bf16 autocast over float32 master weights, closedloop beside
TRL's ``SFTTrainer`` and ``GRPOTrainer`` on the same work in the same process, with each
trainer's peak GPU memory.

The work and the matched settings are the benchmarks' own (``benchmarks/bench_sft_vs_trl.py``,
``benchmarks/bench_grpo_vs_trl.py``; their docstrings list what is matched and the one
deliberate difference); this part runs their ``run_ours``/``run_trl`` at GPU sizes:

- SFT: packed rows of 2,048 tokens (both trainers pack with BFD, padding-free), batch 8, 12 steps,
  the first 4 untimed; throughput counts non-padding tokens between step ends.
- GRPO: P=4 prompts x G=8 generations, 64 new tokens, 4 steps (the first is the warm-up);
  closedloop's rollouts are episodes of the ``react`` graph decoded by ``hf:`` continuous batching
  on the live policy, TRL's are its own ``generate`` (no vLLM on either side).

Order: closedloop first, then TRL, once each (a lent GPU has minutes, not repeats): the ratio is
one run's. Peak memory is ``torch.cuda.max_memory_allocated`` from a reset before each trainer.
A dry run does the same at toy sizes on the CPU (no peak memory there).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from common import Recorder, part_main
from part_model import model_dir
from report import table

GPU = {"sft": dict(rows=1500, steps=12, warmup=4, batch_size=8, max_length=2048, packing=True, lr=2e-5),
       "grpo": dict(steps=4, prompts=4, generations=8, max_new_tokens=64, lr=1e-6)}
DRY = {"sft": dict(rows=48, steps=4, warmup=1, batch_size=2, max_length=1024, packing=True, lr=2e-5),
       "grpo": dict(steps=3, prompts=1, generations=2, max_new_tokens=4, lr=1e-6)}


def _measured(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``'s result with its wall time and the GPU's peak allocation during it."""
    import torch

    gc.collect()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    out["peak_memory_GiB"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if cuda else None
    gc.collect()
    return out


def sft(rec: Recorder, model: str, work: Path, s: dict[str, Any]) -> dict[str, Any]:
    import bench_sft_vs_trl as bench

    args = argparse.Namespace(steps=s["steps"], warmup=s["warmup"], batch_size=s["batch_size"], rows=s["rows"],
                              max_length=s["max_length"], lr=s["lr"], packing=s["packing"], mixed_precision="bf16",
                              threads=1, seed=0)
    rows = bench.make_rows(args.rows, args.seed)
    data = work / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out: dict[str, Any] = {"settings": s}
    for name, fn in (("closedloop", lambda: bench.run_ours(model, data, work / "sft_ours", args)),
                     ("trl", lambda: bench.run_trl(model, rows, work / "sft_trl", args))):
        out[name] = _measured(fn)
        rec.set("sft", out)
    out["ratio_tokens_per_s"] = out["closedloop"]["tokens_per_s"] / out["trl"]["tokens_per_s"]
    rec.set("sft", out)
    return out


def grpo(rec: Recorder, model: str, work: Path, s: dict[str, Any]) -> dict[str, Any]:
    import bench_grpo_vs_trl as bench

    args = argparse.Namespace(steps=s["steps"], prompts=s["prompts"], generations=s["generations"],
                              max_new_tokens=s["max_new_tokens"], lr=s["lr"], loss_type="dapo", problems=256, seed=42,
                              prefetch_rollouts="on", mixed_precision="bf16")
    plan = bench.planned_seeds(args.seed, args.steps, args.prompts, args.problems)
    out: dict[str, Any] = {"settings": s}
    for name, fn in (("closedloop", lambda: bench.run_ours(model, work / "grpo_ours", args, plan)),
                     ("trl", lambda: bench.run_trl(model, work / "grpo_trl", args, plan))):
        run = _measured(fn)
        summary = bench.summarise(name, [run])
        out[name] = {k: summary[k] for k in ("s_per_step_median", "rollout_s_median", "rest_s_median",
                                             "tokens_per_step", "prompts_match_plan")}
        out[name].update(wall_s=run["wall_s"], peak_memory_GiB=run["peak_memory_GiB"])
        rec.set("grpo", out)
    out["ratio_s_per_step"] = out["closedloop"]["s_per_step_median"] / out["trl"]["s_per_step_median"]
    rec.set("grpo", out)
    return out


def run(rec: Recorder, args: argparse.Namespace) -> str:
    import torch

    model = model_dir(args.work)
    if not (model / "config.json").is_file():
        rec.skip("training", "the model part left no checkpoint")
        return "failed"
    sizes = DRY if args.dry_run else GPU
    rec.set("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        a = sft(rec, str(model), Path(tmp), sizes["sft"])
        if rec.remaining() < 20:
            rec.skip("grpo", "the part's time ran out after SFT")
            return "failed"
        b = grpo(rec, str(model), Path(tmp), sizes["grpo"])
    rec.summary(table(["", "closedloop", "TRL", "closedloop / TRL", "peak GiB (ours / TRL)"], [
        ["SFT non-padding tokens/s", a["closedloop"]["tokens_per_s"], a["trl"]["tokens_per_s"],
         a["ratio_tokens_per_s"], f"{a['closedloop']['peak_memory_GiB']} / {a['trl']['peak_memory_GiB']}"],
        ["GRPO s/step (median)", b["closedloop"]["s_per_step_median"], b["trl"]["s_per_step_median"],
         b["ratio_s_per_step"], f"{b['closedloop']['peak_memory_GiB']} / {b['trl']['peak_memory_GiB']}"]])
        + ["", "Goals from the benchmarks: SFT ratio >= 1; GRPO ratio <= 0.8 (one run each, closedloop first)."])
    return "ok"


if __name__ == "__main__":
    part_main("training", run)
