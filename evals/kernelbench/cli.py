"""``closedloop eval kernelbench``: evaluate an agent graph (or candidate files) on KernelBench problems.

    closedloop eval kernelbench --problems DIR --level 1 --backend cpu --agent kernel --model SPEC \\
        --samples K --concurrency N [--scale 0.015625] [--export eval_results.json] [--plot speedups.png]
    closedloop eval kernelbench --problems DIR --level 1 --candidates RUN_DIR      # no agent
    closedloop eval kernelbench --problems DIR --level 1 --candidate-source reference   # self-check

Results go to the run store (one eval run, one child per sample), so an interrupted run resumes
with the same ``--name``. ``--executor ray [--ray-address ADDR]`` runs the samples as Ray tasks
(one GPU each on cuda; on cpu a CPU slot and the node's ``cpu_timing`` slot, which a joined
cluster's nodes declare with ``ray start --resources '{"cpu_timing": 1}'``); verdicts come back
here and are written exactly as locally. Registered through the ``closedloop.benchmarks`` entry point.

Progress goes to stderr through :class:`closedloop.terminal.JobProgress`: a live bar on a terminal;
in a log one line per sample as it finishes (which sample, its status and speedup, the correct
count so far), so a long run can be followed with ``tail -f``. The summary goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from closedloop.evals.harness.flags import add_executor_arguments


def register(bench: argparse._SubParsersAction) -> None:
    k = bench.add_parser("kernelbench", help="KernelBench-compatible kernel evaluation (cpu, triton, cuda)",
                         description=__doc__.splitlines()[0])
    k.add_argument("--problems", required=True, help="a KernelBench-layout root (level<N>/<id>_<Name>.py), a level dir or a file")
    k.add_argument("--level", type=int, help="only this level")
    k.add_argument("--problem-ids", type=int, nargs="+", metavar="ID")
    k.add_argument("--backend", choices=["cpu", "triton", "cuda"], default="cpu")
    k.add_argument("--agent", help="a registered graph (e.g. kernel, egg); see `closedloop graphs`")
    k.add_argument("--model", help="the agent's model spec")
    k.add_argument("--rounds", type=int, help="agent rounds (passed to the graph)")
    k.add_argument("--candidates", metavar="DIR", help="evaluate candidate files instead of running an agent "
                                                       "(level_<L>_problem_<P>_sample_<S>_kernel.py or <id>_<Name>.py)")
    k.add_argument("--candidate-source", choices=["agent", "files", "reference"],
                   help="where candidates come from (default: agent with --agent, files with --candidates); "
                        "reference: each problem's Model as its ModelNew, a self-check of the harness "
                        "(correct, speedup 1.0x within the timing noise)")
    k.add_argument("--samples", type=int, default=1, help="samples per problem (pass@k)")
    k.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature of the agent (default: the graph's, greedy); pass@k with k > 1 needs > 0")
    k.add_argument("--sampling-seed", type=int, default=0, help="sample i of a problem samples with seed S + i")
    k.add_argument("--concurrency", type=int, default=None,
                   help="samples in flight (default: 2 locally, builds in parallel and timing serial; on Ray, the "
                        "samples the cluster's slots hold)")
    k.add_argument("--scale", type=float, default=1.0, help="scale module-level size constants (e.g. 0.015625 = 1/64)")
    k.add_argument("--policy", choices=["strict", "lenient", "off"], default="strict")
    k.add_argument("--trials", type=int, default=5, help="correctness trials")
    k.add_argument("--tolerance", type=float, default=1e-2, help="atol = rtol (KernelBench v0.1: 1e-2; main fp32: 1e-4)")
    k.add_argument("--iters", type=int, default=20, help="timed iterations per implementation")
    k.add_argument("--compile-reference", action="store_true",
                   help="also time the torch.compile reference (slow on CPU: inductor builds C++)")
    k.add_argument("--item-timeout", type=float, metavar="S", help="seconds per sample (agent + evaluation)")
    k.add_argument("--cache-dir", help="kernel build cache (default: $CLOSEDLOOP_KERNEL_CACHE or ~/.cache/closedloop/kernels)")
    k.add_argument("--store", help="run store file (default: $CLOSEDLOOP_STORE or ~/.closedloop/runs.duckdb)")
    k.add_argument("--name", help="the evaluation's name; an existing name is resumed")
    k.add_argument("--resume", action="store_true", help="resume --name (refuse if it does not exist)")
    k.add_argument("--export", metavar="PATH", help="write KernelBench-style eval_results.json here")
    k.add_argument("--plot", metavar="PATH", help="write a speedup-distribution plot (PNG) here")
    add_executor_arguments(k, per_item="cuda: 1 CPU slot and 1 GPU; cpu: 1 CPU slot and the node's cpu_timing slot; "
                                       "triton: 1 CPU slot")
    k.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from closedloop.evals.harness import ExecutorUnavailable
    from closedloop.evals.kernelbench.runner import KernelBenchConfigError
    from closedloop.plugins import PluginNotFound

    try:
        return asyncio.run(_run(args))
    except (KernelBenchConfigError, PluginNotFound, ValueError, FileNotFoundError, ExecutorUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


async def _run(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from closedloop.evals.harness import executor_config_from_args, make_executor
    from closedloop.evals.kernelbench.evaluate import backend_available
    from closedloop.evals.kernelbench.problems import load_problems
    from closedloop.evals.kernelbench.runner import (CPU_TIMING, KernelBenchSettings,
                                                     sample_resources, settings_agent)
    from closedloop.store import RunStore
    from closedloop.terminal import make_console

    source = args.candidate_source or ("files" if args.candidates else "agent")
    if source == "reference":
        if args.agent or args.candidates:
            raise ValueError("--candidate-source reference takes neither --agent nor --candidates")
    elif bool(args.agent) == bool(args.candidates):
        raise ValueError("give either --agent (with --model), --candidates or --candidate-source reference")
    elif (source == "files") != bool(args.candidates):
        raise ValueError(f"--candidate-source {source} does not match the options given")
    if args.agent and not args.model:
        raise ValueError(f"--agent {args.agent} needs --model")
    if args.samples < 1 or (args.concurrency is not None and args.concurrency < 1):
        raise ValueError("--samples and --concurrency must be at least 1")
    executor_config = executor_config_from_args(args)
    ok, why = backend_available(args.backend)
    err = make_console(stderr=True)
    if not ok:
        err.print(f"[yellow]note[/]: backend {args.backend}: {escape(why)}")
    problems = load_problems(args.problems, level=args.level, ids=args.problem_ids)
    sha = hashlib.sha256("".join(p.key + p.hash for p in problems).encode()).hexdigest()[:16]
    label = args.agent or _SOURCE_LABELS[source]
    name = args.name or f"kernelbench-{args.backend}-{label}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    settings = KernelBenchSettings(
        name=name, problems_dir=str(args.problems), problems_sha=sha, level=args.level, backend=args.backend,
        scale=args.scale, policy=args.policy, agent=args.agent, model=args.model, rounds=args.rounds,
        candidates_dir=args.candidates, candidate_source=source, samples=args.samples, concurrency=1,
        temperature=args.temperature, sampling_seed=args.sampling_seed,
        item_timeout_s=args.item_timeout, trials=args.trials, atol=args.tolerance, rtol=args.tolerance,
        iters=args.iters, compile_reference=args.compile_reference,
        # absolute: Ray workers do not share this process's working directory
        cache_dir=str(Path(args.cache_dir).expanduser().resolve()) if args.cache_dir else None)
    if args.agent and args.samples > 1 and not args.temperature:
        err.print(f"[yellow]note[/]: {args.samples} samples per problem with greedy decoding are identical; "
                  "give --temperature > 0 for pass@k")
    store = RunStore(args.store) if args.store else RunStore()
    # ray: joins (or starts, declaring the timing slot) the cluster here
    executor = make_executor(executor_config, local_resources={CPU_TIMING: 1})
    try:
        concurrency = args.concurrency or (2 if executor.in_process else executor.capacity(
            executor_config.item_resources(sample_resources(settings))))
        settings = settings.model_copy(update={"concurrency": concurrency})
        # on Ray the workers build the agent from the settings; here it is built only for local runs
        agent = settings_agent(settings) if executor.in_process else None
        return await _evaluate(args, settings, problems, store, agent, executor, err)
    finally:
        executor.close()


async def _evaluate(args: argparse.Namespace, settings: Any, problems: list[Any], store: Any, agent: Any,
                    executor: Any, err: Any) -> int:
    from rich.markup import escape
    from rich.table import Table

    from closedloop.evals.kernelbench.export import plot_speedups, write_eval_results
    from closedloop.evals.kernelbench.runner import KernelBenchRunner
    from closedloop.terminal import JobProgress, make_console

    name = settings.name
    no_agent = settings.source() != "agent"  # candidate files or the references: no agent to blame
    title = f"kernelbench {settings.backend} {settings.agent or _SOURCE_LABELS[settings.source()]}"
    progress: dict[str, JobProgress] = {}
    correct = {"n": 0}

    def on_plan(total: int, reused: int) -> None:  # the progress opens once the store has said what it holds
        if reused:
            correct["n"] = sum(r.correct for r in runner.stored_results()[0])
        progress["job"] = JobProgress(title, total, done=reused, unit="samples").__enter__()
        if reused:
            progress["job"].note(f"{title}: {reused} of {total} samples already in the store "
                                 f"({correct['n']} correct)")

    def on_sample(so) -> None:
        correct["n"] += so.result is not None and so.result.correct
        progress["job"].advance(**_sample_metrics(so, no_agent), correct=correct["n"])

    runner = KernelBenchRunner(settings, problems, store, agent=agent, on_sample=on_sample, on_plan=on_plan,
                               executor=executor)
    try:
        report = await runner.run(resume=args.resume)
    except (KeyboardInterrupt, asyncio.CancelledError):
        if "job" in progress:
            progress["job"].close()
        err.print(f"[yellow]interrupted[/]: finished samples are stored; resume with [bold]--name {escape(name)}[/]")
        raise KeyboardInterrupt from None
    finally:
        if "job" in progress:
            progress["job"].close()
        client = getattr(agent, "client", None)
        if client is not None:
            await client.aclose()
    out = make_console()
    s = report.summary
    table = Table(title=escape(f"KernelBench {report.name}" + (" (resumed)" if report.resumed else "")),
                  show_header=False, caption=escape(f"run {report.parent_id} in {store.path}"))
    table.add_row("samples", f"{len(report.results)} graded of {report.total} (ran {report.ran}, from store "
                             f"{report.reused}) in {report.wall_s:.1f}s; scale {settings.scale:g}")
    table.add_row("outcomes", ", ".join(f"{_outcome_label(k, no_agent)}: {v}"
                                        for k, v in sorted(report.outcomes.items())) or "-")
    table.add_row("statuses", ", ".join(f"{k}: {v}" for k, v in s["statuses"].items()) or "-")
    table.add_row("fast_p", "  ".join(f"{k}={v:.3f}" for k, v in s["fast_p"].items()) if report.results
                  else "- (nothing graded)")
    gm = s.get("geomean_speedup")
    if gm is not None:
        table.add_row("geomean speedup", f"{gm:.3f}x over eager torch (correct samples with a stable timing)")
    else:
        table.add_row("geomean speedup", "- (no correct sample with a stable timing)" if s["statuses"].get("correct")
                      else "-")
    for key in (k for k in s if k.startswith("pass@")):
        table.add_row(key, "-" if s[key] is None else f"{s[key]:.3f}")
    if s["suspicious"]:
        table.add_row("suspicious", f"{len(s['suspicious'])} (excluded from fast_p until reviewed)")
    out.print(table)
    for e in report.errors[:10]:
        out.print(f"  [red]{_outcome_label(e['outcome'], no_agent)}[/] {escape(e['problem'])} sample "
                  f"{e['sample_id']}: {escape(str(e['error'])[:200])}")
    if args.export:  # never claims a file it did not write
        paths = write_eval_results(report.results, args.export) if report.results else {}
        out.print("exported " + ", ".join(escape(str(p)) for p in paths.values()) if paths
                  else f"export: nothing written to {escape(str(args.export))} (no sample was graded)")
    if args.plot:
        if not any(r.speedup for r in report.results if r.status in ("correct", "suspicious")):
            out.print(f"plot: nothing written to {escape(str(args.plot))} (no correct sample has a speedup)")
        else:
            p = plot_speedups(report.results, args.plot)
            out.print(f"plot: {escape(str(p))}" if p else "plot: matplotlib is not installed; nothing written")
    return 0


#: How a run without an agent is named (its default ``--name``, its progress line).
_SOURCE_LABELS = {"reference": "reference", "files": "candidates", "agent": "agent"}


def _sample_metrics(so: Any, no_agent: bool) -> dict[str, Any]:
    """What a sample's progress line says about it: which sample, its verdict (the judge's status, or
    why there is none: a timeout, the agent's or the candidate file's error) and its speedup."""
    result = so.result
    if result is None or result.speedup is None:
        speedup = "-"
    else:  # an unstable timing is shown but, as the summary says, not in the geomean or fast_p
        speedup = f"{result.speedup:.2f}x" + (" (unstable)" if result.timing_unstable else "")
    return {"sample": f"{so.problem.key}#{so.sample_id}",
            "status": result.status if result is not None else _outcome_label(so.outcome, no_agent),
            "speedup": speedup}


def _outcome_label(outcome: str, no_agent: bool) -> str:
    """An outcome as the summary names it: without an agent, ``agent_error`` is the candidate file's
    (missing, or no code in it), and says so."""
    return "candidate file error" if no_agent and outcome == "agent_error" else outcome
