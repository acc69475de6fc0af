"""closedloop's GRPO against TRL's ``GRPOTrainer``, in one run: seconds per step and reward curves.

Same tiny model, same single-turn task, same batch. The task: "What is A plus B?" (A, B in 0..20),
no tools, one assistant reply. Reward components, computed by one function for both trainers on
the same text (the completion ids decoded with ``skip_special_tokens=True``, exactly TRL's
``completions[i][0]["content"]``):

- ``correct``: 1.0 when the last number of the reply is A + B;
- ``format``: 0.25 when the reply starts with "The answer is" (the phrasing the tiny model was
  warmed up on after a tool result; about 2% of its samples at temperature 1), so the curves can
  move before the arithmetic does (the untrained-for sum is almost never right).

closedloop runs its own loop (:func:`closedloop.trainers.grpo.train_grpo`): each episode is the
``react`` graph on the live policy (``HFClient.from_model``) against a one-step environment
defined here; TRL gets the same questions as conversational prompts (rendered by the same chat
template: the benchmark checks that the prompt ids are identical) in the same order (closedloop
draws its seeds as ``train_grpo`` does; TRL reads them in that order with ``shuffle_dataset=False``).

Matched settings: model, prompts per step (P) and generations per prompt (G), max new tokens,
temperature 1.0 (top-p 1, no top-k), learning rate and linear schedule, loss_type, epsilon 0.2,
beta 0, num_iterations 1, group reward scaling, max_grad_norm 1.0, one optimizer step per
generation batch in one micro-batch (TRL: ``per_device_train_batch_size = P*G``,
``gradient_accumulation_steps = steps_per_generation = 1``), one torch thread, the same device (a
GPU when there is one, else the CPU) and precision (``--mixed-precision``), no vLLM, no
evaluation, no reporting. Sampling seeds differ (each trainer seeds its own way), so the reward
curves are two samples of the same process, not identical curves.

Seconds per step: the interval between consecutive step ends (our ``on_step`` callback, TRL's
``on_step_end``), so everything between two optimizer steps counts on both sides (prompt
rendering, generation, reward, loss, backward, optimizer, logging); the first step (warm-up) is
excluded; medians. The ratio is the median over repeats of (closedloop's median / TRL's median) of
the same repeat: the two runs of a repeat are adjacent in time, so a shared machine's drifting load
moves both (``--repeats`` alternates which goes first). Split: closedloop's ``rollout_s`` from its
metrics (the wait for the batch's rollout: with ``prefetch_rollouts``, on by default, the next
batch's episodes start during the update, so part of their set-up is in "rest"); TRL's time in ``_generate_and_score_completions`` (generation + reward + advantages); the
rest of a step is the remainder.

    python benchmarks/bench_grpo_vs_trl.py --steps 20 --prompts 4 --generations 8 --max-new-tokens 32
    python benchmarks/bench_grpo_vs_trl.py --quick
    python benchmarks/bench_grpo_vs_trl.py --model /path/to/hf-model --steps 30

Goal (issue 7): closedloop's seconds per step <= 0.8 x TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GOAL_RATIO = 0.8
FORMAT_WEIGHT = 0.25
QUESTIONS = ["What is {a} plus {b}?", "What is {a} + {b}?", "Compute {a} plus {b}.", "Add {a} and {b}."]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


# --------------------------------------------------------------------------- the task (shared)


def problem(seed: int) -> tuple[str, int]:
    """The question of a seed and its answer (the same seed gives the same problem)."""
    rng = random.Random(seed)
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return rng.choice(QUESTIONS).format(a=a, b=b), a + b


def reward_components(text: str, target: int) -> dict[str, float]:
    """The reward of one reply, by component; both trainers call this on the same text."""
    reply = text.strip()
    numbers = _NUMBER.findall(reply)
    correct = 1.0 if numbers and float(numbers[-1]) == target else 0.0
    return {"correct": correct, "format": FORMAT_WEIGHT if reply.startswith("The answer is") else 0.0}


@dataclass
class StepLog:
    """What each trainer's episodes did, per optimizer step: rewards, generated tokens, prompts."""

    current: list[dict[str, Any]] = field(default_factory=list)
    steps: list[list[dict[str, Any]]] = field(default_factory=list)

    def record(self, **row: Any) -> None:
        self.current.append(row)

    def close_step(self) -> list[dict[str, Any]]:
        rows, self.current = self.current, []
        self.steps.append(rows)
        return rows


class SingleTurnEnv:
    """One question, one reply (satisfies :class:`closedloop.env.AgentEnvironment`).

    The reply is scored on the decoded completion ids with special tokens skipped (what TRL's
    reward functions see), falling back to the message text for an action without token ids.
    """

    def __init__(self, tokenizer: Any, log: StepLog) -> None:
        self.tokenizer, self.log = tokenizer, log
        self.messages: list[Any] = []
        self.seed: int | None = None
        self.target = 0

    async def areset(self, seed: int | None = None) -> tuple[list[Any], dict[str, Any]]:
        from closedloop.messages import UserMessage

        if seed is None:
            raise ValueError("SingleTurnEnv needs a seed (it picks the problem)")
        self.seed = int(seed)
        question, self.target = problem(self.seed)
        self.messages = [UserMessage(content=question)]
        return list(self.messages), {"tools": [], "seed": self.seed}

    async def astep(self, action: Any) -> tuple[list[Any], float, bool, bool, dict[str, Any]]:
        from closedloop.messages import Turn

        message = action.message if isinstance(action, Turn) else action
        ids = list(action.completion_ids or []) if isinstance(action, Turn) else []
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if ids else (message.content or "")
        comps = reward_components(text, self.target)
        self.log.record(seed=self.seed, tokens=len(ids), reward=sum(comps.values()), **comps,
                        prompt_ids=list(action.prompt_ids or []) if isinstance(action, Turn) else None)
        self.messages.append(message)
        return list(self.messages), sum(comps.values()), True, False, {"rewards": comps}


def planned_seeds(seed: int, steps: int, prompts: int, count: int) -> list[list[int]]:
    """The environment seeds ``train_grpo`` draws per step (its ``random.Random(f"{seed}:{rank}")``,
    rank 0); the benchmark checks the recorded ones against this plan."""
    rng = random.Random(f"{seed}:0")
    return [[rng.randrange(count) for _ in range(prompts)] for _ in range(steps)]


# --------------------------------------------------------------------------- the two trainers


def run_ours(model_path: str, out: Path, args: argparse.Namespace, plan: list[list[int]]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from closedloop.trainers.grpo import GRPOConfig, train_grpo

    tok = AutoTokenizer.from_pretrained(model_path)
    log = StepLog()
    batch = args.prompts * args.generations
    cfg = GRPOConfig(model=model_path, output_dir=str(out), graph="react", prompts_per_step=args.prompts,
                     num_generations=args.generations, train_seed_start=0, train_seed_count=args.problems,
                     max_env_steps=1, temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                     loss_type=args.loss_type, beta=0.0, num_iterations=1, scale_rewards="group",
                     learning_rate=args.lr, lr_scheduler="linear", warmup_steps=0, max_grad_norm=1.0,
                     max_steps=args.steps, per_device_batch_size=batch, gradient_accumulation_steps=1,
                     max_batch_size=max(64, batch), max_length=None, logging_steps=1, save_steps=None,
                     report_to=["none"], torch_threads=1, seed=args.seed,
                     prefetch_rollouts=args.prefetch_rollouts == "on", mixed_precision=args.mixed_precision)
    ends: list[float] = []
    rows_per_step: list[list[dict[str, Any]]] = []

    def on_step(step: int, metrics: dict[str, float]) -> None:
        ends.append(time.perf_counter())
        rows_per_step.append(log.close_step())

    result = train_grpo(cfg, make_env=lambda: SingleTurnEnv(tok, log), on_step=on_step)
    seen = [sorted({r["seed"] for r in rows}) for rows in rows_per_step]
    prompts_match = seen == [sorted(set(s)) for s in plan[:len(seen)]]
    return {"ends": ends, "rows": rows_per_step, "history": result.history, "prompts_match": prompts_match,
            "rollout_s": [h["rollout_s"] for h in result.history], "train_s": [h["train_s"] for h in result.history],
            "first_prompt_ids": {r["seed"]: r["prompt_ids"] for r in rows_per_step[0]} if rows_per_step else {}}


def run_trl(model_path: str, out: Path, args: argparse.Namespace, plan: list[list[int]]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    log = StepLog()
    order = [s for step in plan for s in step]
    rows = [{"prompt": [{"role": "user", "content": problem(s)[0]}], "target": problem(s)[1], "seed": s}
            for s in order]

    def correct(prompts, completions, target, seed, completion_ids, **_):  # noqa: ANN001
        out = []
        for c, t, s, ids in zip(completions, target, seed, completion_ids):
            comps = reward_components(c[0]["content"], t)
            log.record(seed=s, tokens=len(ids), reward=sum(comps.values()), **comps)
            out.append(comps["correct"])
        return out

    def format(prompts, completions, target, **_):  # noqa: A001, ANN001 - TRL logs it as rewards/format
        return [reward_components(c[0]["content"], t)["format"] for c, t in zip(completions, target)]

    ends: list[float] = []
    gen_s: list[float] = []
    trl_logs: list[dict[str, float]] = []
    rows_per_step: list[list[dict[str, Any]]] = []

    class Marks(TrainerCallback):
        def on_step_end(self, _args, state, control, **kw):  # noqa: ANN001
            ends.append(time.perf_counter())
            rows_per_step.append(log.close_step())

        def on_log(self, _args, state, control, logs=None, **kw):  # noqa: ANN001
            trl_logs.append(dict(logs or {}))

    batch = args.prompts * args.generations
    cfg = GRPOConfig(output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                     steps_per_generation=1, num_generations=args.generations,
                     max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                     learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0,
                     loss_type=args.loss_type, beta=0.0, num_iterations=1, epsilon=0.2, scale_rewards="group",
                     max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
                     use_vllm=False, use_cpu=not torch.cuda.is_available(), shuffle_dataset=False, seed=args.seed,
                     bf16=args.mixed_precision == "bf16", fp16=args.mixed_precision == "fp16",
                     dataloader_pin_memory=False, disable_tqdm=True, log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[correct, format], args=cfg,
                          train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Marks()])
    trainer.remove_callback(PrinterCallback)  # a dict per step on stdout; closedloop's metrics go to its progress bar
    inner = trainer._generate_and_score_completions

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            gen_s.append(time.perf_counter() - t0)

    trainer._generate_and_score_completions = timed  # instance attribute: the split of a step, nothing else
    trainer.train()
    seen = [sorted({r["seed"] for r in rows}) for rows in rows_per_step]
    prompts_match = seen == [sorted(set(s)) for s in plan[:len(seen)]]
    return {"ends": ends, "rows": rows_per_step, "rollout_s": gen_s, "logs": trl_logs, "prompts_match": prompts_match}


# --------------------------------------------------------------------------- report


def _intervals(ends: list[float]) -> list[float]:
    """Seconds of steps 2..N (between consecutive step ends); step 1 is the warm-up."""
    return [b - a for a, b in zip(ends, ends[1:])]


def _per_step(runs: list[dict[str, Any]], value: Any) -> list[float]:
    """``value(rows of one step)`` per step, averaged over the repeats."""
    per_run = [[value(rows) for rows in run["rows"]] for run in runs]
    return [statistics.fmean(xs) for xs in zip(*per_run)]


def summarise(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Timing over every timed step of every repeat (medians); curves averaged over repeats.

    ``rollout_s`` of a run is its per-step rollout time; the rest of a step is the remainder.
    """
    steps_s = [x for run in runs for x in _intervals(run["ends"])]
    rollout = [x for run in runs for x in run["rollout_s"][1:]]
    rest = [s - r for run in runs for s, r in zip(_intervals(run["ends"]), run["rollout_s"][1:])]
    mean = statistics.fmean
    return {"trainer": name, "steps": len(runs[0]["rows"]), "repeats": len(runs),
            "s_per_step_median": statistics.median(steps_s),
            "s_per_step_median_by_repeat": [statistics.median(_intervals(r["ends"])) for r in runs],
            "s_per_step": [_intervals(r["ends"]) for r in runs], "rollout_s_median": statistics.median(rollout),
            "rest_s_median": statistics.median(rest),
            "tokens_per_step": _per_step(runs, lambda rs: sum(r["tokens"] for r in rs)),
            "reward_per_step": _per_step(runs, lambda rs: mean(r["reward"] for r in rs)),
            "correct_per_step": _per_step(runs, lambda rs: mean(r["correct"] for r in rs)),
            "format_per_step": _per_step(runs, lambda rs: mean(r["format"] for r in rs)),
            "prompts_match_plan": all(r["prompts_match"] for r in runs)}


def plot(path: Path, ours: dict[str, Any], trl: dict[str, Any], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for s, style in ((ours, "-o"), (trl, "-s")):
        xs = range(1, len(s["reward_per_step"]) + 1)
        ax1.plot(xs, s["reward_per_step"], style, ms=3, label=s["trainer"])
        for i, ys in enumerate(s["s_per_step"]):
            ax2.plot(range(2, len(ys) + 2), ys, style, ms=3, alpha=0.8 if i == 0 else 0.4,
                     color=ax2.lines[-1].get_color() if i else None, label=s["trainer"] if i == 0 else None)
    ax1.set(xlabel="step", ylabel="mean reward (correct + format)", title="reward per step (mean over repeats)")
    ax2.set(xlabel="step", ylabel="seconds", title="seconds per step (step 1 = warm-up, not shown)")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an HF chat model directory (default: build the tiny model)")
    p.add_argument("--tiny-train-steps", type=int, default=None,
                   help="SFT warm-up steps of the built tiny model (default 500; 100 with --quick)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of each trainer (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    p.add_argument("--generations", type=int, default=8, help="generations per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of both (high: a 150k-param model)")
    p.add_argument("--loss-type", default="dapo", choices=["grpo", "dr_grpo", "dapo", "bnpo"])
    p.add_argument("--problems", type=int, default=256, help="distinct problems prompts are drawn from")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--repeats", type=int, default=1, help="run both trainers this many times, alternating which "
                                                           "goes first (the machine's load drifts); medians")
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 steps, P=2, G=4, 16 tokens (and a tiny "
                                                         "model warmed up for 100 steps when built)")
    p.add_argument("--prefetch-rollouts", choices=["on", "off"], default="on",
                   help="closedloop starts the next batch's episodes during the update (GRPOConfig.prefetch_rollouts)")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"],
                   help="both trainers: autocast with float32 master weights (a GPU, when there is one, is used by both)")
    p.add_argument("--out", default="out/bench_grpo_vs_trl", help="folder for results.json and rewards.png")
    args = p.parse_args()
    if args.quick:
        args.steps, args.prompts, args.generations, args.max_new_tokens = 4, 2, 4, 16
    if args.tiny_train_steps is None:
        args.tiny_train_steps = 100 if args.quick else 500
    if args.steps < 3:
        p.error("--steps must be >= 3 (one warm-up step, then at least two timed intervals)")
    if args.generations < 2:
        p.error("--generations must be >= 2 (GRPO groups)")

    import torch
    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(1)
    console = Console(width=max(Console().width, 120))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = planned_seeds(args.seed, args.steps, args.prompts, args.problems)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_path = args.model
        if model_path is None:
            from closedloop.models.tiny import build_tiny_model

            console.print(f"building the tiny model ({args.tiny_train_steps} warm-up steps) ...")
            model_path = str(build_tiny_model(tmp_path / "tiny", seed=0, train_steps=args.tiny_train_steps))
        runs: dict[str, list[dict[str, Any]]] = {"closedloop": [], "trl": []}
        for r in range(args.repeats):
            for name in (["closedloop", "trl"] if r % 2 == 0 else ["trl", "closedloop"]):
                console.print(f"[bold]repeat {r + 1}/{args.repeats}, {name}[/]: {args.steps} steps, P={args.prompts}, "
                              f"G={args.generations}, {args.max_new_tokens} new tokens")
                runner = run_ours if name == "closedloop" else run_trl
                runs[name].append(runner(model_path, tmp_path / f"{name}{r}", args, plan))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        same_prompts = all(
            ids == tok.apply_chat_template([{"role": "user", "content": problem(s)[0]}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
            for s, ids in runs["closedloop"][0]["first_prompt_ids"].items())

    ours = summarise("closedloop", runs["closedloop"])
    ours["train_s_median"] = statistics.median(x for run in runs["closedloop"] for x in run["train_s"][1:])
    trl = summarise("trl", runs["trl"])
    ratios = [o / t for o, t in zip(ours["s_per_step_median_by_repeat"], trl["s_per_step_median_by_repeat"])]
    ratio = statistics.median(ratios)

    table = Table(title=f"GRPO: {args.repeats} x {args.steps} steps (first untimed), P={args.prompts} x G={args.generations}, "
                        f"{args.max_new_tokens} new tokens, lr {args.lr}, {args.loss_type}, 1 thread, CPU")
    for col in ("trainer", "s/step", "rollout s", "rest s", "tokens/step", "reward first 5 → last 5",
                "correct", "format"):
        table.add_column(col, justify="left" if col == "trainer" else "right")
    for s in (ours, trl):
        r = s["reward_per_step"]
        k = min(5, len(r))
        table.add_row(s["trainer"], f"{s['s_per_step_median']:.3f}", f"{s['rollout_s_median']:.3f}",
                      f"{s['rest_s_median']:.3f}", f"{statistics.fmean(s['tokens_per_step']):.0f}",
                      f"{statistics.fmean(r[:k]):.3f} → {statistics.fmean(r[-k:]):.3f}",
                      f"{statistics.fmean(s['correct_per_step']):.3f}", f"{statistics.fmean(s['format_per_step']):.3f}")
    console.print(table)
    verdict = "[green]meets[/]" if ratio <= GOAL_RATIO else "[red]misses[/]"
    console.print(f"ratio closedloop / TRL seconds per step: [bold]{ratio:.2f}[/] ({verdict} the goal <= {GOAL_RATIO}; "
                  f"median over repeats of {', '.join(f'{x:.2f}' for x in ratios)}); "
                  f"prompt ids identical: {same_prompts}; prompts in plan order: "
                  f"closedloop {ours['prompts_match_plan']}, TRL {trl['prompts_match_plan']}")
    console.print(f"rollout: closedloop rollout_s (graph episodes on the live policy, rewards), TRL "
                  f"_generate_and_score_completions (generation, rewards, advantages); rest: the remainder of the "
                  f"step (batching, loss, backward, optimizer, logging). closedloop train_s (loss+backward+optimizer) "
                  f"median: {ours['train_s_median']:.3f} s")
    results = {"settings": {k: v for k, v in vars(args).items()}, "model": args.model or "tiny (built)",
               "ratio_ours_over_trl": ratio, "ratio_by_repeat": ratios, "goal_ratio": GOAL_RATIO, "meets_goal": ratio <= GOAL_RATIO,
               "prompt_ids_identical": same_prompts, "closedloop": ours, "trl": trl,
               "closedloop_history": [r["history"] for r in runs["closedloop"]],
               "trl_logs": [r["logs"] for r in runs["trl"]]}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    plot(out_dir / "rewards.png", ours, trl, f"closedloop GRPO vs TRL GRPOTrainer: P={args.prompts}, "
                                             f"G={args.generations}, {args.max_new_tokens} tokens, ratio {ratio:.2f}")
    console.print(f"wrote {out_dir / 'results.json'} and {out_dir / 'rewards.png'}")


if __name__ == "__main__":
    main()
