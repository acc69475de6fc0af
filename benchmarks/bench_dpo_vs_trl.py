"""closedloop's DPO loop against TRL's ``DPOTrainer``, in one run: seconds per optimizer step.

Same model (the tiny tool-calling model, built untrained here unless ``--model`` is given), same
preference pairs (prompt = a synthetic conversation up to its last assistant message, chosen = that
message, rejected = the last assistant message of another conversation), same batch size, β, loss,
learning rate, schedule, precision and thread count, a reference model scored every step on both
sides (no precomputation), gradient checkpointing the same on both (off by default: TRL's
DPOConfig turns it on, closedloop does not). Time per step is measured between step ends after the warm-up steps,
so model loading, tokenisation and saving are excluded on both sides.

    python benchmarks/bench_dpo_vs_trl.py --steps 60 --batch-size 8 --threads 1
    python benchmarks/bench_dpo_vs_trl.py --model /path/to/hf-model --steps 30

Goal: ours ≤ 0.8 × TRL's seconds per step.
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
    """Conversational preference rows (tool-call arguments as JSON text, no tool schemas)."""
    from closedloop.models.tiny import synthetic_conversation

    rng = random.Random(seed)
    convs = []
    for _ in range(n + 1):
        msgs, _ = synthetic_conversation(rng)
        for m in msgs:
            for c in m.get("tool_calls") or []:
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"])
        convs.append(msgs)
    return [{"prompt": a[:-1], "chosen": a[-1:], "rejected": b[-1:]} for a, b in zip(convs, convs[1:])
            if a[-1]["content"] != b[-1]["content"]][:n]


def seconds_per_step(marks: list[tuple[int, float]], warmup: int) -> float:
    marks = sorted(marks)
    start = next(m for m in marks if m[0] >= warmup)
    return (marks[-1][1] - start[1]) / (marks[-1][0] - start[0])


def run_ours(model_path: str, rows: list[dict[str, Any]], out: Path, args: argparse.Namespace) -> dict[str, float]:
    from closedloop.trainers.config import load_config
    from closedloop.trainers.dpo import DPOConfig, train_dpo

    cfg = load_config(DPOConfig, None, [
        f"model={model_path}", f"output_dir={out}", f"max_steps={args.steps}", f"per_device_batch_size={args.batch_size}",
        f"learning_rate={args.lr}", "lr_scheduler=linear", f"beta={args.beta}", f"loss_type={args.loss_type}",
        f"max_length={args.max_length}", "report_to=none", f"torch_threads={args.threads}", f"seed={args.seed}",
        f"mixed_precision={args.mixed_precision}", "logging_steps=1000",
        f"gradient_checkpointing={str(args.gradient_checkpointing).lower()}"])
    marks: list[tuple[int, float]] = []
    result = train_dpo(cfg, rows, on_step=lambda step, m: marks.append((step, time.perf_counter())))
    return {"s_per_step": seconds_per_step(marks, args.warmup), "loss": result.metrics.get("loss", float("nan")),
            "tokens": result.history[-1]["tokens_per_s"] * result.history[-1]["step_s"]}


def run_trl(model_path: str, rows: list[dict[str, Any]], out: Path, args: argparse.Namespace) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    marks: list[tuple[int, float]] = []
    losses: list[float] = []

    class Marks(TrainerCallback):
        def on_step_end(self, _args, state, control, **kw):  # noqa: ANN001
            marks.append((state.global_step, time.perf_counter()))

        def on_log(self, _args, state, control, logs=None, **kw):  # noqa: ANN001
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_path)
    cfg = DPOConfig(output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                    learning_rate=args.lr, lr_scheduler_type="linear", beta=args.beta, loss_type=[args.loss_type],
                    max_length=args.max_length, logging_steps=args.steps, report_to="none", save_strategy="no",
                    seed=args.seed, use_cpu=not torch.cuda.is_available(), bf16=args.mixed_precision == "bf16",
                    fp16=args.mixed_precision == "fp16", dataloader_pin_memory=False, disable_tqdm=True,
                    gradient_checkpointing=args.gradient_checkpointing)
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
                         callbacks=[Marks()])
    trainer.train()
    return {"s_per_step": seconds_per_step(marks, args.warmup), "loss": losses[-1] if losses else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an HF model directory (default: build the tiny model untrained)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from timing")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss-type", default="sigmoid", choices=["sigmoid", "hinge", "ipo"])
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="both recompute activations (TRL's DPOConfig default is on, closedloop's off; the "
                        "comparison sets the same on both sides, off unless given)")
    p.add_argument("--repeats", type=int, default=1, help="alternate the two trainers this many times; medians")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")

    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(args.threads)
    console = Console(width=150)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_path = args.model
        if model_path is None:
            from closedloop.models.tiny import build_tiny_model

            console.print("building the tiny model (untrained) ...")
            model_path = str(build_tiny_model(tmp_path / "tiny", train_steps=0))
        rows = make_rows(args.rows, args.seed)
        results: dict[str, list[dict[str, float]]] = {"closedloop": [], "trl": []}
        for r in range(args.repeats):
            console.print(f"[bold]repeat {r + 1}/{args.repeats}[/]: closedloop DPO")
            results["closedloop"].append(run_ours(model_path, rows, tmp_path / f"ours{r}", args))
            console.print(f"[bold]repeat {r + 1}/{args.repeats}[/]: TRL DPOTrainer")
            results["trl"].append(run_trl(model_path, rows, tmp_path / f"trl{r}", args))

    table = Table(title=f"DPO ({args.loss_type}): {args.steps} steps (first {args.warmup} untimed), batch "
                        f"{args.batch_size} pairs, reference scored each step, {args.mixed_precision}, "
                        f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, "
                        f"{args.threads} thread(s)")
    for col in ("trainer", "s/step (median)", "last loss"):
        table.add_column(col, justify="right" if col != "trainer" else "left")
    med: dict[str, float] = {}
    for name, runs in results.items():
        med[name] = statistics.median(r["s_per_step"] for r in runs)
        table.add_row(name, f"{med[name]:.4f}", f"{runs[-1]['loss']:.4f}")
    console.print(table)
    console.print(f"ratio closedloop / TRL seconds per step: [bold]{med['closedloop'] / med['trl']:.2f}[/] "
                  "(goal <= 0.80)")


if __name__ == "__main__":
    main()
