"""``closedloop eval tau``: run (or resume) a τ-bench evaluation into the run store.

Registered through the ``closedloop.benchmarks`` entry point ``tau`` (the core CLI imports no
benchmark). Building the parser imports only argparse (and the harness's argparse-only executor
flags); rich and the τ machinery are imported by the handler, when an evaluation runs.

``--executor ray [--ray-address ADDR]`` runs the episodes as Ray tasks (one CPU slot each, or
``--ray-cpus``); results come back here and are written to the store exactly as locally.

The evaluation is recorded as one ``eval`` run with one child run per episode, written as each
episode ends, so a crash or Ctrl-C loses only the episodes in flight: rerun with the same
``--name`` (or ``--resume``) and only the missing episodes run. ``--export`` writes tau2's
results.json from the store, so an export after a resume holds every episode.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from closedloop.evals.harness.flags import add_executor_arguments

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

from closedloop.evals.infra_errors import add_infra_errors_argument, infra_errors_failure

SCENARIO_USER = "scenario"


def register(bench: argparse._SubParsersAction) -> None:
    """Add ``tau`` to the ``closedloop eval`` benchmark subparsers (entry point ``closedloop.benchmarks``)."""
    t = bench.add_parser("tau", help="τ²-bench (tau2-compatible): run, resume and export an evaluation",
                         description=__doc__.splitlines()[0])
    t.add_argument("--domain", default="retail", help="a registered τ domain (closedloop plugins domains)")
    t.add_argument("--split", default="base", help="task split from split_tasks.json ('base' = all tasks)")
    t.add_argument("--data-dir", help="τ data root holding tau2/domains/<domain>/ (default: $TAU2_DATA_DIR, else the "
                                      "data a domain ships with, as helpdesk does)")
    t.add_argument("--task-ids", nargs="+", metavar="ID", help="run only these tasks of the split")
    t.add_argument("command", nargs="?", choices=["run", "import"], default="run",
                   help="run (the default) an evaluation, or import a tau2 results.json for pass^k")
    t.add_argument("results", nargs="?", metavar="RESULTS_JSON", help="import: a results.json written by tau2 (or us)")
    t.add_argument("--agent", help="a registered graph (see `closedloop graphs`) or 'oracle' (required to run)")
    t.add_argument("--model", help="the agent's model spec (not needed for --agent oracle)")
    t.add_argument("--user-model", help=f"the user simulator's model spec, or '{SCENARIO_USER}' for the model-free "
                                        f"scripted user (the default for --agent oracle)")
    t.add_argument("--judge-model", help="model spec for NL assertions (without it those tasks are not graded)")
    t.add_argument("--trials", type=int, default=1, help="trials per task (pass^1..k)")
    t.add_argument("--concurrency", type=int, help="episodes run at once (default: 4; on Ray, as many as the "
                                                     "cluster's --ray-cpus/--ray-gpus slots hold)")
    t.add_argument("--max-steps", type=int, default=200, help="routing steps before an episode ends (tau2's max_steps)")
    t.add_argument("--max-errors", type=int, default=10, help="tool errors before an episode ends (tau2's max_errors)")
    t.add_argument("--episode-timeout", type=float, metavar="S", help="seconds before an episode ends as timeout")
    t.add_argument("--seed", type=int, default=300, help="master seed; one seed per trial derives from it (tau2)")
    t.add_argument("--temperature", type=float, default=0.0, help="agent sampling temperature")
    t.add_argument("--user-temperature", type=float, default=0.0, help="user simulator sampling temperature (tau2: 0)")
    t.add_argument("--max-tokens", type=int, default=1024, help="agent max tokens per turn")
    t.add_argument("--clarify", action="store_true", help="clarification-enhanced tasks (one detail withheld)")
    t.add_argument("--store", help="run store file (default: $CLOSEDLOOP_STORE or ~/.closedloop/runs.duckdb)")
    t.add_argument("--name", help="the evaluation's name; an existing name is resumed (default: a new name)")
    t.add_argument("--resume", action="store_true",
                   help="resume --name, or the latest unfinished evaluation with this domain/split/agent/model")
    t.add_argument("--export", metavar="PATH", help="write tau2's results.json here when done")
    add_infra_errors_argument(t)
    c = t.add_argument_group("conventions", "tau2's by default; ours by name (recorded in the export's "
                                            "info.conventions). See closedloop.evals.tau.conventions")
    c.add_argument("--gold-sync", action="store_true",
                   help="sync the two telecom DBs after each gold action, as live calls are (tau2's evaluator "
                        "does not, so its db_match compares a synced trajectory with an unsynced gold state)")
    c.add_argument("--ungraded", choices=["fail", "exclude"],
                   help="an episode without a reward (no judge) in pass^k: a failure (tau2, the default) or "
                        "left out; import: as the file's info.conventions says, else tau2's")
    c.add_argument("--pass-k", choices=["capped", "per-task"],
                   help="pass^k up to the smallest trial count of any task (tau2, the default), or each k over "
                        "the tasks with k trials; import: as the file's info.conventions says, else tau2's")
    add_executor_arguments(t)
    t.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from closedloop.evals.harness import ExecutorUnavailable
    from closedloop.evals.tau.data import TauDataError
    from closedloop.evals.tau.runner import EvalConfigError
    from closedloop.models.base import ModelError
    from closedloop.plugins import PluginNotFound

    try:
        if args.command == "import":
            return _import(args)
        if not args.agent:
            raise ValueError("the following arguments are required: --agent")
        return asyncio.run(_tau(args))
    except (TauDataError, EvalConfigError, PluginNotFound, ValueError, ExecutorUnavailable, ModelError) as e:
        # a model that cannot be made (no OPENAI_API_KEY, a checkpoint that is not there) is set-up, one line
        print(f"error: {e}", file=sys.stderr)
        return 2


def _import(args: argparse.Namespace) -> int:
    """``closedloop eval tau import results.json``: tau2's own results, pass^k and counts."""
    from rich.markup import escape
    from rich.table import Table

    from closedloop.evals.tau.metrics import results_metrics
    from closedloop.terminal import make_console
    from closedloop.evals.tau.results import load_tau2_results

    if not args.results:
        raise ValueError("import needs the path of a results.json")
    if not Path(args.results).exists():
        raise ValueError(f"{args.results} does not exist")
    if args.gold_sync:
        raise ValueError("--gold-sync changes how episodes are graded; an imported file was graded already "
                         "(its info.conventions says how)")
    sims, tasks, info = load_tau2_results(args.results)
    metrics = results_metrics(sims, info, **_convention_flags(args))
    env = info.get("environment_info") or {}
    table = Table(title=f"τ results {escape(str(args.results))} ({escape(str(env.get('domain_name', '?')))}, "
                        f"{len(tasks)} tasks, {len(sims)} simulations)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    if metrics.num_graded:
        table.add_row("avg reward", _fmt(metrics.avg_reward) + f"  over {metrics.num_graded} graded episodes")
        _pass_k_rows(table, metrics)
    else:
        table.add_row("graded", "0 episodes (no metric: nothing was graded)")
    reasons: dict[str, int] = {}
    for s in sims:
        reasons[s.termination_reason.value] = reasons.get(s.termination_reason.value, 0) + 1
    table.add_row("terminations", ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items())))
    table.add_row("ungraded (reward_info null)", str(len(metrics.ungraded)))
    table.add_row("infra errors", str(len(metrics.infrastructure_errors)))
    table.add_row("conventions", _conventions_text(metrics.conventions))
    make_console().print(table)
    return 0


def _convention_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The conventions named on the command line (the others stay tau2's, or on import the file's)."""
    return {k: v for k, v in (("gold_sync", args.gold_sync or None), ("ungraded", args.ungraded),
                              ("pass_k", args.pass_k)) if v is not None}


def _conventions_text(conventions: Any) -> str:
    ours = conventions.not_tau2()
    return "tau2's" if not ours else ", ".join(f"{k}={v}" for k, v in ours.items()) + " (not tau2's)"


def _pass_k_rows(table: Table, m: Any) -> None:
    """pass^k for each k asked; a k without a figure says which tasks are short of trials."""
    from rich.markup import escape

    for k in sorted(m.num_tasks):
        if k in m.pass_hat_k:
            table.add_row(f"pass^{k}", f"{_fmt(m.pass_hat_k[k])}  ({m.num_tasks[k]} tasks)")
        else:
            short = m.insufficient.get(k) or []
            why = f"{len(short)} tasks have fewer than {k} trials (e.g. {short[0]})" if short else "no tasks"
            table.add_row(f"pass^{k}", escape(f"-  ({why})"))


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def _load_tasks(args: argparse.Namespace):
    from closedloop.evals.tau import load_domain

    data = load_domain(args.domain, args.data_dir)
    taskset = data.load_tasks(args.split, task_ids=args.task_ids)
    tasks = taskset.tasks
    if args.clarify:
        try:
            from closedloop.evals.tau.clarify import make_clarification_tasks
        except ModuleNotFoundError as e:
            raise ValueError(f"--clarify needs closedloop.evals.tau.clarify, which is not available ({e})") from None
        tasks = make_clarification_tasks(tasks, args.seed)
        if not tasks:
            raise ValueError("--clarify: none of the selected tasks has a detail that can be withheld")
    return data, taskset, tasks


def _resume_name(store: Any, args: argparse.Namespace) -> str:
    from closedloop.evals.tau.eval_store import EVAL_KIND
    from closedloop.evals.tau.runner import EvalConfigError

    for run in store.list_runs(limit=None, kind=EVAL_KIND):  # newest first
        c = run.config
        if (run.status != "completed" and c.get("domain") == args.domain and c.get("split") == args.split
                and c.get("agent") == args.agent and c.get("model") == (None if args.agent == "oracle" else args.model)
                and run.metadata.get("name")):
            return run.metadata["name"]
    raise EvalConfigError(f"--resume: no unfinished {args.domain}/{args.split} evaluation of {args.agent} "
                          f"in {store.path}; give --name")


async def _tau(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from closedloop.evals.harness import Resources, executor_config_from_args, make_executor
    from closedloop.evals.tau.data import resolve_data_root
    from closedloop.evals.tau.orchestrator import load_user_guidelines
    from closedloop.evals.tau.runner import EvalSettings, TauRunner, export_results
    from closedloop.models import parse_spec
    from closedloop.store import RunStore
    from closedloop.terminal import JobProgress, make_console

    oracle = args.agent == "oracle"
    if oracle and args.model:
        print("note: --agent oracle replays the gold actions; --model is not used", file=sys.stderr)
    if not oracle and not args.model:
        raise ValueError(f"--agent {args.agent} needs --model")
    user_spec = args.user_model or (SCENARIO_USER if oracle else None)
    if user_spec is None:
        raise ValueError(f"give --user-model (a model spec, or '{SCENARIO_USER}' for the model-free scripted user)")
    for spec in (None if oracle else args.model, None if user_spec == SCENARIO_USER else user_spec, args.judge_model):
        if spec:
            parse_spec(spec)  # a typo fails before anything is loaded
    if args.trials < 1 or (args.concurrency is not None and args.concurrency < 1):
        raise ValueError("--trials and --concurrency must be at least 1")
    executor_config = executor_config_from_args(args)

    data, taskset, tasks = _load_tasks(args)
    root = resolve_data_root(args.data_dir, args.domain)
    store = RunStore(args.store) if args.store else RunStore()
    resume = args.resume
    name = args.name
    if name is None:
        if resume:
            name = _resume_name(store, args)
        else:
            name = f"tau-{args.domain}-{args.split}-{args.agent}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    executor = make_executor(executor_config)  # ray: joins (or starts) the cluster here
    concurrency = args.concurrency or executor.capacity(executor_config.resources or Resources())
    settings = EvalSettings(
        name=name, domain=args.domain, split=args.split, data_dir=str(root), task_file_sha256=taskset.sha256,
        task_ids=args.task_ids, agent=args.agent, model=None if oracle else args.model,
        user_model=None if user_spec == SCENARIO_USER else user_spec, judge_model=args.judge_model,
        trials=args.trials, concurrency=concurrency, max_steps=args.max_steps, max_errors=args.max_errors,
        episode_timeout_s=args.episode_timeout, seed=args.seed, clarify=args.clarify,
        temperature=None if oracle else args.temperature, max_tokens=None if oracle else args.max_tokens,
        user_temperature=args.user_temperature, **_convention_flags(args))

    err = make_console(stderr=True)
    out = make_console()
    title = f"τ {args.domain}/{args.split} {args.agent}"
    progress: dict[str, JobProgress] = {}

    def on_plan(p) -> None:  # the progress opens once the plan (and what the store already holds) is known
        progress["job"] = JobProgress(title, p.total, done=p.done, unit="episodes").__enter__()
        if p.done:
            progress["job"].note(f"{title}: {p.done} of {p.total} episodes already in the store")

    def on_episode(sim, p) -> None:
        progress["job"].update(p.done, **{"avg reward": _fmt(p.avg_reward), "graded": p.graded,
                                          "infra errors": p.infra_errors})

    try:
        runner = TauRunner.from_settings(settings, tasks, data, store, guidelines=load_user_guidelines(root),
                                         executor=executor, on_episode=on_episode, on_plan=on_plan)
        try:
            report = await runner.run(resume=resume)
        except (KeyboardInterrupt, asyncio.CancelledError):
            if "job" in progress:
                progress["job"].close()
            err.print(f"[yellow]interrupted[/]: finished episodes are stored; resume with "
                      f"[bold]--name {escape(name)}[/] (eval run {runner.parent_id})")
            raise KeyboardInterrupt from None
    finally:
        if "job" in progress:
            progress["job"].close()
        executor.close()
    _print_summary(out, report, store)
    if args.export:
        n = export_results(store, name, tasks, args.export, git_commit=_git_commit())
        out.print(f"exported {n} simulations to {escape(str(args.export))}")
    failure = infra_errors_failure(len(report.summary["infrastructure_errors"]), len(report.simulations),
                                   args.max_infra_errors)
    if failure:
        err.print(f"[red]error:[/] {escape(failure)}")
        return 1
    return 0


def _ungraded_rows(table: Table, summary: dict[str, Any], metrics: Any) -> None:
    """How many episodes have no reward, and why, one reason a row (the judge was not asked: give
    --judge-model; a gold replay that failed under strict_gold_replay; ...)."""
    from rich.markup import escape

    n = summary["ungraded"]
    if not n:
        table.add_row("ungraded", "0")
        return
    counted = "failures" if metrics.conventions.ungraded == "fail" else "left out"
    table.add_row("ungraded", f"{n} episodes (no reward; {counted} in pass^k), because:")
    for reason, count in sorted(summary["ungraded_reasons"].items(), key=lambda kv: -kv[1]):
        hint = "; give --judge-model to grade them" if ("no judge" in reason or "judge was not asked" in reason) else ""
        table.add_row("", escape(f"{count} × {reason}{hint}"))


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print_summary(console: Console, report: Any, store: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    s, m = report.summary, report.metrics
    title = f"τ eval {report.name}" + (" (resumed)" if report.resumed else "")
    table = Table(title=escape(title), show_header=False, caption=escape(f"run {report.parent_id} in {store.path}"))
    table.add_column("metric", style="bold")
    table.add_column("value")
    table.add_row("episodes", f"{len(report.simulations)} of {report.total} (ran {report.ran}, "
                              f"from store {report.reused}) in {report.wall_s:.1f}s")
    table.add_row("graded", f"{m.num_graded} episodes" + (f"  (avg reward {_fmt(m.avg_reward)})" if m.num_graded
                                                          else "  (no metric: nothing was graded)"))
    _ungraded_rows(table, s, m)
    db = s["db"]
    table.add_row("DB match", f"{db['matched']} of {db['checked']} episodes whose DB was checked" if db["checked"]
                  else "- (no episode reached a DB check)")
    if m.num_graded:
        _pass_k_rows(table, m)
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(s["termination_reasons"].items())) or "-"
    table.add_row("terminations", escape(reasons))
    for who, u in s["usage"].items():
        if u["prompt_tokens"] or u["completion_tokens"]:
            cost = "" if u["cost_usd"] is None else f"  ${u['cost_usd']:.4f}"
            table.add_row(f"{who} tokens", f"{u['prompt_tokens']} in / {u['completion_tokens']} out{cost}")
    table.add_row("cost", "-" if s["cost_usd"] is None else f"${s['cost_usd']:.4f}")
    table.add_row("conventions", _conventions_text(m.conventions))
    infra = s["infrastructure_errors"]
    table.add_row("infra errors", f"{len(infra)}  (not counted; re-run on resume)" if infra else "0")
    console.print(table)
    for e in infra[:10]:
        console.print(f"  [red]infra[/] task {escape(str(e['task_id']))} trial {e['trial']}: "
                      f"{escape(str(e['error'])[:200])}")
    if len(infra) > 10:
        console.print(f"  ... and {len(infra) - 10} more")
