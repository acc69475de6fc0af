"""closedloop's SFT loop against TRL's ``SFTTrainer``, in one run: non-padding tokens per second.

Same model (the tiny tool-calling model, built untrained here unless ``--model`` is given), same
conversations (tool-use and chit-chat from ``closedloop.models.tiny``, one fixed tool list so the
rows are identical in both trainers), same batch size, learning rate, schedule, precision and
thread count. Throughput counts the tokens that are not padding (TRL's own ``num_tokens``; ours
``num_tokens``) between the end of the warm-up window and the last step, timed at step ends, so
model loading, tokenisation and saving are excluded on both sides.

One deliberate difference: closedloop trains on assistant tokens only (its default) and TRL on
every token (its default for conversational data; its assistant-only mode needs ``{% generation %}``
markers the tiny template lacks). The mask does not change the compute per token.

    python benchmarks/bench_sft_vs_trl.py --steps 60 --batch-size 8 --threads 1
    python benchmarks/bench_sft_vs_trl.py --packing --max-length 512
    python benchmarks/bench_sft_vs_trl.py --model /path/to/hf-model --steps 30

Goal: ours ≥ TRL's tokens/s (ratio ≥ 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Conversations in OpenAI form with the same three tools on every row (no Arrow null-filling)."""
    from closedloop.models.tiny import synthetic_conversation, tool_schemas

    rng = random.Random(seed)
    tools = list(tool_schemas().values())
    rows = []
    for _ in range(n):
        msgs, _ = synthetic_conversation(rng)
        for m in msgs:
            for c in m.get("tool_calls") or []:
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        rows.append({"messages": msgs, "tools": tools})
    return rows


def throughput(marks: list[tuple[int, float, float]], warmup: int) -> tuple[float, float, float]:
    """(tokens/s, tokens, seconds) between the first mark at step >= warmup and the last mark."""
    marks = sorted(marks)
    start = next(m for m in marks if m[0] >= warmup)
    end = marks[-1]
    tokens, secs = end[2] - start[2], end[1] - start[1]
    return tokens / secs, tokens, secs


def run_ours(model_path: str, data: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    from closedloop.trainers.config import SFTConfig, load_config
    from closedloop.trainers.sft import train_sft

    cfg = load_config(SFTConfig, None, [
        f"model={model_path}", f"output_dir={out}", f"dataset={data}", f"max_steps={args.steps}",
        f"per_device_batch_size={args.batch_size}", f"learning_rate={args.lr}", "lr_scheduler=linear",
        f"max_length={args.max_length}", f"packing={str(args.packing).lower()}", f"logging_steps={args.warmup}",
        "report_to=none", "save_steps=null", f"torch_threads={args.threads}", f"seed={args.seed}",
        f"mixed_precision={args.mixed_precision}"])
    marks: list[tuple[int, float, float]] = []

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if "num_tokens" in metrics:
            marks.append((step, time.perf_counter(), metrics["num_tokens"]))

    result = train_sft(cfg, on_step=on_step)
    tps, tokens, secs = throughput(marks, args.warmup)
    return {"tokens_per_s": tps, "tokens": tokens, "seconds": secs, "loss": result.metrics.get("loss", float("nan"))}


def run_trl(model_path: str, rows: list[dict[str, Any]], out: Path, args: argparse.Namespace) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    marks: list[tuple[int, float, float]] = []
    losses: list[float] = []

    class Marks(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kw):  # noqa: ANN001
            if logs and "num_tokens" in logs:
                marks.append((state.global_step, time.perf_counter(), float(logs["num_tokens"])))
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_path)
    cfg = SFTConfig(output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                    learning_rate=args.lr, lr_scheduler_type="linear", max_length=args.max_length,
                    packing=args.packing, padding_free=args.packing, logging_steps=args.warmup, report_to="none",
                    save_strategy="no", seed=args.seed, use_cpu=not torch.cuda.is_available(),
                    bf16=args.mixed_precision == "bf16", fp16=args.mixed_precision == "fp16",
                    dataloader_pin_memory=False, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
                         callbacks=[Marks()])
    trainer.train()
    tps, tokens, secs = throughput(marks, args.warmup)
    return {"tokens_per_s": tps, "tokens": tokens, "seconds": secs, "loss": losses[-1] if losses else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an HF model directory (default: build the tiny model untrained)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from timing (also the logging interval)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--packing", action="store_true", help="both: packing (BFD) with padding-free rows")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="alternate the two trainers this many times; medians")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")

    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(args.threads)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_path = args.model
        if model_path is None:
            from closedloop.models.tiny import build_tiny_model

            console.print("building the tiny model (untrained) ...")
            model_path = str(build_tiny_model(tmp_path / "tiny", train_steps=0))
        rows = make_rows(args.rows, args.seed)
        data = tmp_path / "data.jsonl"
        data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        results: dict[str, list[dict[str, float]]] = {"closedloop": [], "trl": []}
        for r in range(args.repeats):
            console.print(f"[bold]repeat {r + 1}/{args.repeats}[/]: closedloop SFT")
            results["closedloop"].append(run_ours(model_path, data, tmp_path / f"ours{r}", args))
            console.print(f"[bold]repeat {r + 1}/{args.repeats}[/]: TRL SFTTrainer")
            results["trl"].append(run_trl(model_path, rows, tmp_path / f"trl{r}", args))

    table = Table(title=f"SFT throughput: {args.steps} steps (first {args.warmup} untimed), batch {args.batch_size}, "
                        f"packing={args.packing}, {args.mixed_precision}, {args.threads} thread(s)")
    for col in ("trainer", "non-padding tokens/s", "tokens timed", "seconds timed", "last loss"):
        table.add_column(col, justify="right" if col != "trainer" else "left")
    med: dict[str, float] = {}
    for name, runs in results.items():
        med[name] = statistics.median(r["tokens_per_s"] for r in runs)
        last = runs[-1]
        table.add_row(name, f"{med[name]:,.0f}", f"{last['tokens']:,.0f}", f"{last['seconds']:.2f}", f"{last['loss']:.4f}")
    console.print(table)
    ratio = med["closedloop"] / med["trl"]
    console.print(f"ratio closedloop / TRL tokens/s: [bold]{ratio:.2f}[/] (goal >= 1.00; losses differ by design: "
                  "assistant-only vs all tokens)")


if __name__ == "__main__":
    main()
