"""``closedloop eval factguard``: FactGuard evaluation from the command line.

    closedloop eval factguard --data DIR --agent factguard --model hf:PATH [--split test] [--concurrency 8]
    closedloop eval factguard --synthetic DIR --n 40 ...   # write the synthetic dataset first

Prints Acc/P/R/F1 with 95% intervals, writes ``--out`` JSON, and records every episode in the
run store.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from closedloop.evals.infra_errors import add_infra_errors_argument, infra_errors_failure


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("factguard", help="FactGuard (video misinformation): FakeSV/FakeTT/FakeVV or synthetic data",
                         description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="dataset directory (samples.jsonl, data_complete.json or data.json)")
    p.add_argument("--dataset", choices=["fakesv", "fakett", "fakevv", "samples"], help="format (default: detected)")
    p.add_argument("--split", choices=["train", "test", "all"], default="test", help="temporal split (newest 15%% = test)")
    p.add_argument("--agent", default="factguard", help="a registered graph (default: factguard)")
    p.add_argument("--model", required=True, help="model spec (hf:PATH, openai:NAME[@URL], vllm:PATH)")
    p.add_argument("--vision", action=argparse.BooleanOptionalAction, default=None,
                   help="show frames to the model (default: when the model is a local VLM)")
    p.add_argument("--corpus", help="evidence index (default: DATA/corpus.duckdb, else $CLOSEDLOOP_SEARCH backend)")
    p.add_argument("--asr", help="hf:<speech model> that transcribes videos with no transcript")
    p.add_argument("--concurrency", type=int, default=4, help="samples evaluated at once")
    p.add_argument("--limit", type=int, help="evaluate only the first N samples of the split")
    p.add_argument("--max-tokens", type=int, default=512, help="max tokens per model turn")
    p.add_argument("--synthetic", type=int, metavar="N", help="first write an N-sample synthetic dataset into --data")
    p.add_argument("--store", help="run store file (default: $CLOSEDLOOP_STORE or ~/.closedloop/runs.duckdb)")
    p.add_argument("--out", help="write the report JSON here")
    add_infra_errors_argument(p)
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from closedloop.evals.factguard.data import load_samples, temporal_split
    from closedloop.evals.factguard.evaluate import evaluate_factguard
    from closedloop.models import SamplingParams, make_client, parse_spec
    from closedloop.models.locate import locate_checkpoint
    from closedloop.store import RunStore
    from closedloop.terminal import JobProgress, make_console
    from closedloop.tools.factprobe import LocalCorpus, backend_from_env

    console = make_console()
    try:  # the model spec first: a typo or a checkpoint that was never built fails before the data is written
        spec = parse_spec(args.model)
        if spec.backend in ("hf", "vllm"):
            locate_checkpoint(spec.model)
    except ValueError as e:
        console.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    data = Path(args.data)
    if args.synthetic:
        from closedloop.evals.factguard.synthetic import make_synthetic

        make_synthetic(data, n=args.synthetic)
        console.print(f"wrote {args.synthetic} synthetic samples to {data}")
    try:
        samples = load_samples(data, args.dataset)
    except (FileNotFoundError, ValueError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    if args.split != "all":
        train, test = temporal_split(samples)
        samples = test if args.split == "test" else train
    samples = samples[: args.limit] if args.limit else samples
    corpus = Path(args.corpus) if args.corpus else data / "corpus.duckdb"
    try:
        backend = LocalCorpus(corpus) if corpus.exists() else backend_from_env()
    except (FileNotFoundError, ValueError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    from closedloop.models.base import ModelError

    try:
        client = make_client(args.model)
    except ModelError as e:  # no OPENAI_API_KEY, a model that cannot be loaded: one line
        console.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    vision = args.vision
    if vision is None:
        from closedloop.models.hf_vision import HFVisionClient

        vision = isinstance(client, HFVisionClient)
    store = RunStore(args.store) if args.store else RunStore()
    counts = {"answered": 0, "errors": 0}

    def on_result(result) -> None:
        counts["answered"] += result.predicted is not None
        counts["errors"] += result.error is not None
        progress.advance(answered=counts["answered"], errors=counts["errors"])

    with JobProgress(f"factguard {args.split}", len(samples), unit="samples") as progress:
        report = evaluate_factguard(samples, client, backend, graph=args.agent, vision=vision,
                                    params=SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                                    concurrency=args.concurrency, store=store, asr=args.asr, on_result=on_result)
    console.print(summary_table(report, f"FactGuard · {args.agent} · {client.spec} · {len(samples)} samples "
                                        f"({args.split})", args.concurrency))
    errors = [r for r in report.results if r.error]
    if errors:
        console.print(f"[yellow]{len(errors)} sample(s) failed (scored unanswered); first: "
                      f"{escape(str(errors[0].error))}[/yellow]")
    if args.out:
        Path(args.out).write_text(report.model_dump_json(indent=2))
        console.print(f"wrote {escape(args.out)}")
    store.close()
    failure = infra_errors_failure(len(errors), len(report.results), args.max_infra_errors)
    if failure:
        console.print(f"[red]error:[/red] {escape(failure)}")
        return 1
    return 0


def summary_table(report, title: str, concurrency: int):
    """The metrics with their intervals, or "nothing answered" when no sample got a verdict (a
    metric over zero answers would be the unanswered convention's number, not the model's)."""
    from rich.markup import escape
    from rich.table import Table

    m = report.metrics
    table = Table(title=escape(title))
    for col in ("metric", "value", "95% interval"):
        table.add_column(col)
    answered = m.n - m.unanswered
    if answered == 0:
        table.add_row("accuracy, precision, recall, f1", "-", f"nothing answered: {m.n} of {m.n} samples have no "
                                                               "verdict")
    else:
        for key in ("accuracy", "precision", "recall", "f1"):
            lo, hi = getattr(m, f"{key}_ci")
            table.add_row(key, f"{getattr(m, key):.3f}", f"[{lo:.3f}, {hi:.3f}]")
    note = "  (no verdict; scored as real, as the reference does)" if m.unanswered and answered else ""
    table.add_row("answered", f"{answered} of {m.n}", note.strip())
    table.add_row("tool use", f"{report.tool_rate:.2f}", "")
    table.add_row("samples / min", f"{report.samples_per_minute:.1f}", f"concurrency {concurrency}")
    return table
