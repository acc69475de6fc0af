"""``closedloop runs``: list, show, export and prune the run store.

Reads go through :class:`~closedloop.store.RunStore`, which opens the file only per operation and
read-only under a shared lock, so these commands work while an evaluation or a training job in
another process is writing to the same store, and never see half of a write. A ``--store`` path
that cannot be a store (a directory, a text file, ``/dev/null``, a missing directory) is one
line on stderr and exit code 2 (:mod:`closedloop.store.location`).
``runs export --format sft|pairs|groups`` writes training rows through
:mod:`closedloop.store.export`; ``--parquet DIR`` dumps every table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime, timedelta
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from closedloop.messages import AssistantMessage
from closedloop.terminal import make_console
from closedloop.store import TERMINAL_STATUSES, RunNotFoundError, RunRecord, RunStore, RunSummary
from closedloop.store.export import rows_for, write_jsonl

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
_STATUS_STYLE = {"running": "cyan", "completed": "green", "failed": "red", "killed": "magenta", "interrupted": "yellow"}


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s`` (a bare number is rejected: the unit is too easy to guess wrong)."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: use a number with s, m, h or d, e.g. 30d")
    return timedelta(**{_UNITS[m.group(2)]: float(m.group(1))})


def _duration_text(d: timedelta) -> str:
    """``30 days``, ``12 hours``, ``90 minutes``: a duration as it was given, not timedelta's ``30 days, 0:00:00``."""
    seconds = d.total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return f"{seconds:g} seconds"


def _console() -> Console:
    # Tables wider than 80 columns stay readable when piped or captured.
    return make_console()


def _store(args: argparse.Namespace) -> RunStore:
    return RunStore(args.store)


def _fmt_time(ts: datetime | None) -> str:
    return ts.strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _fmt_cost(cost: float | None) -> str:
    return "-" if cost is None else f"${cost:.4f}"


def _fmt_duration(run: RunSummary) -> str:
    d = run.duration_s
    return "-" if d is None else f"{d:.1f}s"


def cmd_list(args: argparse.Namespace) -> int:
    store = _store(args)
    runs = store.list_runs(limit=args.limit, status=args.status, graph=args.graph, kind=args.kind)
    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in runs], indent=2))
        return 0
    table = Table(title=f"runs ({len(runs)})", caption=escape(str(store.path)))
    for col in ("id", "kind", "graph", "model", "status", "started (UTC)", "duration", "tokens in/out", "cost"):
        table.add_column(col, no_wrap=col in ("id", "status"))
    for r in runs:
        style = _STATUS_STYLE.get(r.status, "")
        table.add_row(r.id[:12], escape(r.kind), escape(r.graph or "-"), escape(r.model_spec or "-"), f"[{style}]{r.status}[/]",
                      _fmt_time(r.started_at), _fmt_duration(r), f"{r.prompt_tokens}/{r.completion_tokens}",
                      _fmt_cost(r.cost_usd))
    _console().print(table)
    return 0


def _show(run: RunRecord, console: Console) -> None:
    console.print(f"[bold]run {run.id}[/]  kind={escape(run.kind)}  graph={escape(run.graph or '-')}  "
                  f"model={escape(run.model_spec or '-')}")
    console.print(f"status: [{_STATUS_STYLE.get(run.status, '')}]{run.status}[/]  pid={run.pid}@{run.hostname}  "
                  f"started {_fmt_time(run.started_at)}  ended {_fmt_time(run.ended_at)}  duration {_fmt_duration(run)}")
    console.print(f"tokens: {run.prompt_tokens} prompt / {run.completion_tokens} completion  cost {_fmt_cost(run.cost_usd)}")
    if run.tags:
        console.print(f"tags: {', '.join(run.tags)}", markup=False)
    if run.config:
        console.print(f"config: {json.dumps(run.config)}", markup=False)

    console.rule(f"messages ({len(run.messages)})")
    for i, m in enumerate(run.messages):
        extra = ""
        if isinstance(m, AssistantMessage) and m.tool_calls:
            extra = "  -> " + ", ".join(f"{c.name}({c.function.arguments})" for c in m.tool_calls)
        console.print(f"{i:>3} {m.role}: {m.text}{extra}", markup=False)

    table = Table(title=f"turns ({len(run.turns)})")
    for col in ("#", "model", "prompt tok", "completion tok", "token ids", "finish", "latency", "cost"):
        table.add_column(col)
    for i, t in enumerate(run.turns):
        table.add_row(str(i), escape(t.model or "-"), str(t.usage.prompt_tokens), str(t.usage.completion_tokens),
                      "yes" if t.has_tokens else "no", escape(t.finish_reason or "-"),
                      "-" if t.latency_s is None else f"{t.latency_s:.3f}s", _fmt_cost(t.usage.cost_usd))
    console.print(table)

    table = Table(title=f"tool calls ({len(run.tool_calls)})")
    for col in ("#", "turn", "name", "arguments", "latency", "result / error"):
        table.add_column(col, overflow="fold")
    for c in run.tool_calls:
        shown = f"[red]{escape(f'{c.error_kind}: {c.error}'[:500])}[/]" if c.error else escape((c.result or "")[:500])
        table.add_row(str(c.idx), "-" if c.turn_idx is None else str(c.turn_idx), escape(c.name),
                      escape(c.arguments or ""), "-" if c.latency_s is None else f"{c.latency_s:.3f}s", shown)
    console.print(table)

    console.rule("outcome")
    console.print(json.dumps(run.outcome, indent=2) if run.outcome is not None else "-", markup=False)
    if run.error:
        console.rule("error")
        console.print(run.error, markup=False)


def _show_metrics(metrics: list[dict[str, float]], console: Console) -> None:
    """One line per metric: how many steps logged it, first, last, min, max."""
    if not metrics:
        return
    series: dict[str, list[float]] = {}
    for row in metrics:
        for name, value in row.items():
            if name != "step":
                series.setdefault(name, []).append(value)
    table = Table(title=f"metrics ({len(metrics)} steps, {metrics[0]['step']}..{metrics[-1]['step']})")
    for col in ("metric", "steps", "first", "last", "min", "max"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for name, values in sorted(series.items()):
        table.add_row(escape(name), str(len(values)), *(f"{v:.4g}" for v in
                                                        (values[0], values[-1], min(values), max(values))))
    console.print(table)


def cmd_show(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        if args.id == "latest":  # the newest top-level run: what a person just ran
            newest = store.list_runs(limit=1)
            if not newest:
                raise RunNotFoundError(f"no runs in {store.path}")
            args.id = newest[0].id
        run = store.get_run(args.id)
    except RunNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(run.model_dump_json(indent=2))
    else:
        console = _console()
        _show(run, console)
        _show_metrics(store.metrics(run.id), console)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.parquet is not None:
        if args.format is not None or args.out is not None:
            print("error: give either --parquet DIR or --format with --out, not both", file=sys.stderr)
            return 2
        paths = _store(args).export_parquet(args.parquet)
        for table, path in paths.items():
            print(f"{table}: {path}")
        return 0
    if args.format == "otlp":  # spans over OTLP/HTTP (closedloop.telemetry), not rows into a file
        from closedloop.telemetry.otlp import export_otlp_command

        return export_otlp_command(args)
    if args.format is None or args.out is None:
        print("error: give --format sft|pairs|groups with --out FILE.jsonl (or --parquet DIR)", file=sys.stderr)
        return 2
    status = None if args.status == "any" else args.status
    trajectories = _store(args).iter_trajectories(kind=args.kind, graph=args.graph, tag=args.tag, status=status,
                                                  min_reward=args.min_reward)
    options = {"strategy": args.pairs} if args.format == "pairs" else {}
    seen = {"runs": 0, "rewarded": 0}

    def counted(items: Any) -> Any:
        for traj in items:
            seen["runs"] += 1
            seen["rewarded"] += bool(traj.rewards)
            yield traj

    count = write_jsonl(rows_for(args.format, counted(trajectories), **options), args.out)
    print(f"wrote {count} {args.format} row(s) to {args.out}" + ("" if count else f": {_why_no_rows(args, seen)}"))
    return 0


def _why_no_rows(args: argparse.Namespace, seen: dict[str, int]) -> str:
    """Why an export came out empty, from what the filters matched."""
    if not seen["runs"]:
        filters = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in (("kind", args.kind), ("graph", args.graph),
                            ("tag", args.tag), ("status", args.status), ("min_reward", args.min_reward)) if v is not None)
        return f"no run matched ({filters})"
    if args.format == "sft":
        return f"{seen['runs']} run(s) matched, none with an assistant message"
    return (f"{seen['runs']} run(s) matched, {seen['rewarded']} with rewards; {args.format} need runs of the same task "
            f"with different rewards (evaluate or train to record some)")


def cmd_prune(args: argparse.Namespace) -> int:
    count = _store(args).delete_older_than(args.older_than)
    print(f"deleted {count} run(s) that ended more than {_duration_text(args.older_than)} ago")
    if args.artifacts:  # the same retention for tool artifacts (closedloop.artifacts)
        from closedloop.artifacts import prune_artifacts

        rep = prune_artifacts(older_than=args.older_than)
        print(f"deleted {rep.removed} artifact(s) ({rep.freed_bytes / 2**20:.1f} MiB) older than "
              f"{_duration_text(args.older_than)}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=None, metavar="PATH",
                        help="DuckDB file (default: $CLOSEDLOOP_STORE or ~/.closedloop/runs.duckdb)")

    p = sub.add_parser("runs", help="list, show, export and prune recorded runs")
    runs_sub = p.add_subparsers(dest="runs_command", required=True)

    ls = runs_sub.add_parser("list", parents=[common], help="recent runs, newest first")
    ls.add_argument("--limit", type=int, default=20, help="at most this many runs")
    ls.add_argument("--status", choices=("running",) + TERMINAL_STATUSES, help="only runs with this status")
    ls.add_argument("--graph", help="only runs of this graph")
    ls.add_argument("--kind", help="run, eval, train, ...")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=cmd_list)

    show = runs_sub.add_parser("show", parents=[common], help="one run: messages, turns, tool calls, outcome")
    show.add_argument("id", help="run id, a unique prefix of it, or 'latest' (the newest run)")
    show.add_argument("--json", action="store_true", help="print the run as one JSON object")
    show.set_defaults(func=cmd_show)

    export = runs_sub.add_parser("export", parents=[common],
                                 help="training rows as JSONL (--format), or every table as Parquet (--parquet)")
    export.add_argument("--parquet", metavar="DIR", help="write one Parquet file per table into DIR")
    export.add_argument("--format", choices=("sft", "pairs", "groups", "otlp"),
                        help="sft: conversations; pairs: preference pairs (same task, different reward); "
                             "groups: GRPO groups per task; otlp: OpenTelemetry spans sent to --endpoint")
    export.add_argument("--endpoint", metavar="URL", help="otlp: OTLP/HTTP receiver (default: $OTEL_EXPORTER_OTLP_"
                                                          "ENDPOINT, else http://localhost:4318)")
    export.add_argument("--out", metavar="FILE.jsonl", help="--format sft|pairs|groups: the JSONL file to write")
    export.add_argument("--kind", help="only runs of this kind (train, episode, run, ...)")
    export.add_argument("--graph", help="only runs of this graph")
    export.add_argument("--tag", help="only runs with this tag")
    export.add_argument("--min-reward", type=float, help="only episodes whose summed rewards reach this")
    export.add_argument("--status", default="completed", choices=("any", "running") + TERMINAL_STATUSES,
                        help="only runs with this status (default: completed; 'any' for all)")
    export.add_argument("--pairs", default="all", choices=("all", "best_worst"),
                        help="pairs: every pair with different rewards, or best against worst per task")
    export.set_defaults(func=cmd_export)

    prune = runs_sub.add_parser("prune", parents=[common], help="delete finished runs older than a duration")
    prune.add_argument("--older-than", required=True, type=parse_duration, metavar="DURATION",
                       help="e.g. 30d, 12h, 90m, 45s")
    prune.add_argument("--artifacts", action="store_true",
                       help="also delete tool artifacts older than the duration (the artifacts directory)")
    prune.set_defaults(func=cmd_prune)
