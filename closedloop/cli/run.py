"""``closedloop run GRAPH --model SPEC [--input TEXT]``: run an agent graph once, or a REPL.

With ``--input`` the graph runs once and prints the answer once; without it, an interactive session
streams tokens (chat markup such as ``<tool_call>`` and ``<|im_end|>`` hidden: calls are shown as
``→ name(arguments)``), shows each tool call and result, and asks before tools that need approval
(an explicit ``y``; Enter alone answers nothing). A turn that ends without an answer says why.
Every run is recorded in the run store.

Threads (``--checkpoint FILE --thread T``) resume exactly where they stopped: a thread whose last
run was killed mid-step re-runs that step (the model call is made again, the user message is not
added twice when the same ``--input`` is given), and a pending approval is asked again. When an
approval cannot be asked (no terminal: stdin closed), the run is recorded as ``waiting`` with the
pending request in its outcome, and the same command resumes it later.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

from rich.markup import escape
from rich.panel import Panel
from rich.prompt import Prompt

from closedloop import plugins
from closedloop.messages import AssistantMessage, ToolMessage, UserMessage
from closedloop.models import SamplingParams, make_client
from closedloop.models.chat_format import END_MARKERS, TOOL_CALL_OPEN
from closedloop.runtime import context_for, load_graph, make_checkpointer, with_checkpointer
from closedloop.runtime.convert import as_closedloop, role_of
from closedloop.runtime.execute import GraphRun, run_graph
from closedloop.runtime.recording import StoreRecorder
from closedloop.terminal import make_console

console = make_console()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run an agent graph once, or interactively without --input")
    p.add_argument("graph", help="a registered graph (see `closedloop graphs`)")
    p.add_argument("--model", required=True, help="model spec: openai:<model>[@<url>], hf:<path>, vllm:<path>")
    p.add_argument("--input", help="the user message; omit for an interactive session")
    p.add_argument("--tools", default="arithmetic", help="comma-separated tool modules (`closedloop tools`); '' for none")
    p.add_argument("--system", help="system prompt (default: the graph's)")
    p.add_argument("--max-turns", type=int, default=8, help="model turns per user message before the graph stops")
    p.add_argument("--max-tokens", type=int, default=256, help="max tokens per model turn")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, help="sampling seed (with --temperature > 0)")
    p.add_argument("--approve", nargs="?", const="*", default=None,
                   help="ask before running tools: all (no value) or a comma-separated list")
    p.add_argument("--checkpoint", help="SQLite file for LangGraph checkpoints (resumable with --thread)")
    p.add_argument("--thread", help="thread id to resume or continue (needs --checkpoint)")
    p.add_argument("--store", help="run store file (default: $CLOSEDLOOP_STORE or ~/.closedloop/runs.duckdb)")
    p.add_argument("--no-store", action="store_true", help="do not record the run")
    p.add_argument("--no-stream", action="store_true", help="do not stream tokens")
    p.add_argument("--otlp", nargs="?", const="", default=None, metavar="URL",
                   help="export the run live as OpenTelemetry GenAI spans over OTLP/HTTP to URL (without URL: "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4318); ids equal those of a later "
                        "`closedloop runs export --format otlp` of the stored run (pip install 'closedloop[otel]')")
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


def _approve_option(value: str | None) -> bool | list[str]:
    if value is None:
        return False
    return True if value == "*" else [v for v in value.split(",") if v]


async def _run(args: argparse.Namespace) -> int:
    graph = load_graph(args.graph)
    tools = plugins.tool_registry([m for m in args.tools.split(",") if m]) if args.tools else None
    import duckdb

    from closedloop.models.base import ModelError
    from closedloop.redact import redact_text

    try:  # the store first (cheap), then the model (may load weights): each problem as one line
        store = _open_store(args)
        if args.otlp is not None:
            _check_otlp(args.otlp)  # refused before the model loads
        client = make_client(args.model)
    except (ValueError, OSError, ModelError, duckdb.Error) as e:
        text = " ".join(redact_text(f"{type(e).__name__}: {e}").split())
        console.print(f"[red]error:[/red] {escape(text)}", highlight=False, soft_wrap=True)
        return 2
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    # With --input the answer is shown once, in its panel; the REPL streams it as it is written.
    options: dict[str, Any] = dict(client=client, tools=tools, params=params, max_turns=args.max_turns,
                                   approve=_approve_option(args.approve),
                                   stream_tokens=args.input is None and not args.no_stream)
    if args.system:
        options["system_prompt"] = args.system
    if args.thread and not args.checkpoint:
        console.print("[yellow]--thread without --checkpoint: nothing to resume from (in-memory thread)[/yellow]")
    thread = args.thread or uuid.uuid4().hex
    config = {"configurable": {"thread_id": thread}}
    run_id = _start_run(store, args, thread) if store else None
    status, outcome, error = "failed", {}, None
    live: Any = None  # the live OTLP recorder (--otlp)
    try:
        saver_cm = make_checkpointer("sqlite", args.checkpoint) if args.checkpoint else None
        saver = await saver_cm.__aenter__() if saver_cm else make_checkpointer("memory")
        try:
            recorder: Any = StoreRecorder(store, run_id) if store and run_id else None
            if args.otlp is not None:
                from closedloop.telemetry.live import OtelRecorder

                live = recorder = OtelRecorder(recorder, run_id or uuid.uuid4().hex, graph=args.graph,
                                               model_spec=client.spec, endpoint=args.otlp or None)
            run = _Run(with_checkpointer(graph, saver), config, context_for(graph, **options), recorder)
            result = await _drive(run, args.input, resume=bool(args.checkpoint))
            if result.paused:
                status = "waiting"
                outcome = {"pending": result.interrupts, "thread_id": thread}
                console.print(f"[yellow]waiting for approval; resume with --checkpoint {args.checkpoint} "
                              f"--thread {thread}[/yellow]" if args.checkpoint else
                              "[yellow]waiting for approval, but without --checkpoint the thread is lost[/yellow]")
            else:
                final = _final_answer(result)
                outcome = {"answer": final, "thread_id": thread}
                status = "completed"
                if args.input is not None:
                    if final:
                        console.print(Panel(escape(final), title="answer", border_style="green", expand=False))
                    else:
                        console.print(f"[yellow]no answer: {escape(_why_no_answer(result))}[/yellow]")
        finally:
            if saver_cm:
                await saver_cm.__aexit__(None, None, None)
    except (KeyboardInterrupt, asyncio.CancelledError):
        status = "interrupted"
        raise
    except Exception as e:
        error = redact_text(f"{type(e).__name__}: {e}")  # a spec's URL key must not reach the terminal
        console.print(f"[red]error:[/red] {error}")
        return 1
    finally:
        if live is not None:
            live.end(status, error=error)  # the run's span; flushes the exporter
        if store:
            store.finish_run(run_id, status=status, outcome=outcome, error=error)
            console.print(f"[dim]run {run_id} recorded in {store.path} (thread {thread})[/dim]")
        await client.aclose()
    return 0


def _check_otlp(endpoint: str) -> None:
    """``--otlp``'s endpoint is an http(s) URL (or empty: the exporter's environment) and the SDK
    is installed; a ``ValueError`` saying which otherwise."""
    import importlib.util

    if importlib.util.find_spec("opentelemetry") is None or importlib.util.find_spec("opentelemetry.sdk") is None:
        raise ValueError("--otlp needs the OpenTelemetry SDK: pip install 'closedloop[otel]'")
    if endpoint:
        from closedloop.telemetry.otlp import traces_url

        traces_url(endpoint)


@dataclass
class _Run:
    """One command's graph run: the graph (with its checkpointer), the thread, the run context and
    the recorder: the store's (None with ``--no-store``), wrapped by the live OTLP one with ``--otlp``."""

    graph: Any
    config: dict[str, Any]
    context: Any
    recorder: Any

    async def __call__(self, graph_input: Any, on_event: Any) -> GraphRun:
        return await run_graph(self.graph, graph_input, config=self.config, context=self.context, on_event=on_event,
                               recorder=self.recorder, durability="sync")


async def _drive(run: _Run, text: str | None, *, resume: bool) -> GraphRun:
    """The command's run: a stopped thread first (``resume``), then ``text`` as a new user message
    unless the stopped run was answering that very message, or the REPL without ``text``."""
    resumed = await _resume(run, text) if resume else None
    if resumed is not None and (resumed[0].paused or resumed[1]):
        return resumed[0]
    if text is None:
        return await _repl(run, resumed[0] if resumed else None)
    return await _turn(run, {"messages": [UserMessage(content=text)]}, show_answer=False)


async def _resume(run: _Run, text: str | None) -> tuple[GraphRun, bool] | None:
    """Continue a thread that stopped midway; ``None`` when it has nothing pending.

    A pending approval is asked again (its interrupt is still in the checkpoint); a step that a
    killed process did not finish is re-run from the last checkpoint (``None`` input), so the
    model call happens again and nothing is added twice. Also returns whether ``text`` is the user
    message that the stopped run was answering.
    """
    snapshot = await run.graph.aget_state(run.config)
    messages = as_closedloop((snapshot.values or {}).get("messages", []))
    thread = run.config["configurable"]["thread_id"]
    if not snapshot.next:
        if messages:  # a finished thread continues: say so, or it looks like a fresh session
            console.print(f"[yellow]resumed thread {escape(thread)}: {len(messages)} earlier messages, which the "
                          f"model sees[/yellow]")
        return None
    last_user = next((m.text for m in reversed(messages) if role_of(m) == "user"), None)
    pending = [i.value for task in snapshot.tasks for i in task.interrupts]
    console.print(f"[yellow]resuming thread {escape(thread)} at {', '.join(snapshot.next)}"
                  + (" (approval pending)" if pending else "") + "[/yellow]")
    if pending:
        result = await _turn(run, None, pending=GraphRun(state=dict(snapshot.values), interrupts=pending),
                             show_answer=text is None)
    else:
        result = await _turn(run, None, show_answer=text is None)
    return result, text is not None and text == last_user


def _open_store(args: argparse.Namespace) -> Any:
    """The run store (None with ``--no-store``), opened before the model so a bad ``--store`` fails
    before any weights load."""
    if args.no_store:
        return None
    from closedloop.store import RunStore

    store = RunStore(args.store) if args.store else RunStore()
    store.list_runs(limit=1)  # a file DuckDB opens that is not a run store fails here, not after the model loads
    return store


def _start_run(store: Any, args: argparse.Namespace, thread: str) -> str:
    config = {k: v for k, v in vars(args).items() if k not in {"func", "input"}}
    return store.start_run(kind="run", graph=args.graph, model_spec=args.model, config=config,
                           metadata={"thread_id": thread})


def _ask(request: dict) -> dict | None:
    """Ask about each action of one approval request: run it (y), decline it (n) or edit its
    arguments (e, then JSON). ``None`` when nobody can answer (stdin closed)."""
    decisions: list[dict[str, Any]] = []
    try:
        for action in request.get("action_requests", []):
            args = action.get("args")
            shown = args if isinstance(args, str) else json.dumps(args)
            # No default: Enter alone (or an empty line piped in) must never approve a call.
            answer = Prompt.ask(f"run [cyan]{escape(str(action.get('name')))}[/cyan]({escape(shown)})? yes / no / edit",
                                choices=["y", "n", "e"], console=console)
            if answer == "y":
                decisions.append({"type": "approve"})
            elif answer == "n":
                decisions.append({"type": "reject", "message": "declined at the terminal"})
            else:
                while True:
                    text = Prompt.ask("arguments (a JSON object)", default=shown, console=console)
                    try:
                        edited = json.loads(text)
                    except json.JSONDecodeError as e:
                        console.print(f"[red]not JSON: {e}[/red]")
                        continue
                    if isinstance(edited, dict):
                        break
                    console.print("[red]the arguments must be a JSON object[/red]")
                decisions.append({"type": "edit", "edited_action": {"name": action.get("name"), "args": edited}})
    except EOFError:
        console.print()
        return None
    return {"decisions": decisions}


class MarkupFilter:
    """Streamed text as a person should read it: end-of-turn markers (``<|im_end|>``, ...) dropped,
    and nothing from a ``<tool_call>`` on (the call is shown parsed, as ``→ name(args)``, when the
    message is complete). A delta that ends with the beginning of a marker is held back until the
    next one says whether it was one."""

    HIDDEN_FROM = TOOL_CALL_OPEN
    DROPPED = END_MARKERS

    def __init__(self) -> None:
        self._held = ""
        self.hiding = False

    def feed(self, delta: str) -> str:
        if self.hiding:
            return ""
        text = self._held + delta
        for marker in self.DROPPED:
            text = text.replace(marker, "")
        cut = text.find(self.HIDDEN_FROM)
        if cut >= 0:
            self.hiding, self._held = True, ""
            return text[:cut]
        keep = max((k for m in (self.HIDDEN_FROM, *self.DROPPED) for k in range(1, len(m))
                    if text.endswith(m[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The end of a message: what was held back is plain text after all."""
        text, self._held, self.hiding = ("" if self.hiding else self._held), "", False
        return text


async def _turn(run: _Run, graph_input: Any, pending: GraphRun | None = None, *,
                show_answer: bool = True) -> GraphRun:
    """Run until the graph ends, asking the user about each pending approval (LangChain's HITL
    request/decision shape). Returns a paused run when an approval could not be asked.
    ``show_answer``: print the final text (the REPL; ``--input`` shows it in a panel instead)."""
    from langgraph.types import Command

    streaming = {"open": False, "streamed": False}
    markup = MarkupFilter()

    def on_event(event: tuple[str, Any]) -> None:
        kind, payload = event
        if kind == "token":
            text = markup.feed(payload)
            if text:
                console.print(text, end="", markup=False, highlight=False)
                streaming["open"] = True
            streaming["streamed"] = True
            return
        rest = markup.flush()
        if rest:
            console.print(rest, end="", markup=False, highlight=False)
            streaming["open"] = True
        if streaming["open"]:
            console.print()
            streaming["open"] = False
        streamed, streaming["streamed"] = streaming["streamed"], False
        if kind == "message" and isinstance(payload, AssistantMessage) and payload.tool_calls:
            for call in payload.tool_calls:
                console.print(f"[cyan]→ {escape(call.name)}[/cyan]({escape(call.function.arguments)})")
        elif kind == "message" and isinstance(payload, AssistantMessage) and TOOL_CALL_OPEN in payload.text:
            console.print(f"[yellow]the model wrote a tool call that could not be read: "
                          f"{escape(_visible(payload.text))}[/yellow]")
        elif kind == "message" and isinstance(payload, AssistantMessage) and not streamed and show_answer \
                and payload.text:
            console.print(_visible(payload.text), markup=False, highlight=False)  # --no-stream: the answer, once
        elif kind == "message" and isinstance(payload, ToolMessage):
            style = "red" if payload.error else "green"
            console.print(f"[{style}]← {escape(payload.name or '')}: {escape(payload.text[:500])}[/{style}]")

    result = pending or await run(graph_input, on_event)
    while result.paused:
        answer = _ask(result.interrupts[0]) if len(result.interrupts) == 1 else None
        if answer is None:
            break
        result = await run(Command(resume=answer), on_event)
    if streaming["open"]:
        console.print()
    if show_answer and not result.paused and not _final_answer(result):
        console.print(f"[yellow]no answer: {escape(_why_no_answer(result))}[/yellow]")
    return result


def _visible(text: str) -> str:
    """Model text without end-of-turn markers."""
    for marker in END_MARKERS:
        text = text.replace(marker, "")
    return text.strip()


async def _repl(run: _Run, result: GraphRun | None = None) -> GraphRun:
    console.print("[bold]closedloop[/bold] interactive session — empty line or Ctrl-D to quit")
    result = result or GraphRun(state={})
    while not result.paused:
        try:
            text = console.input("[bold blue]you> [/bold blue]")
        except EOFError:
            console.print()  # Ctrl-D leaves the cursor on the prompt line
            break
        if not text.strip():
            break
        result = await _turn(run, {"messages": [UserMessage(content=text)]})
    return result


def _final_answer(result: GraphRun) -> str:
    """The last plain answer of the current invocation (not one from earlier in the thread); a
    reply that is an unreadable tool call is no answer."""
    for m in reversed(as_closedloop(result.state.get("messages", []))):
        if role_of(m) == "user":
            break
        if isinstance(m, AssistantMessage) and not m.tool_calls:
            return "" if TOOL_CALL_OPEN in m.text else _visible(m.text)
    return ""


def _why_no_answer(result: GraphRun) -> str:
    """Why the current invocation ended without a plain answer, from its last message."""
    messages = as_closedloop(result.state.get("messages", []))
    last = messages[-1] if messages else None
    if isinstance(last, AssistantMessage) and TOOL_CALL_OPEN in last.text:
        return "the model's last reply was a tool call that could not be read"
    if isinstance(last, AssistantMessage) and last.tool_calls:
        return "the model asked for a tool call and the turn budget (--max-turns) ran out"
    if isinstance(last, ToolMessage):
        return "the turn budget (--max-turns) ran out after a tool result"
    if isinstance(last, AssistantMessage):
        return "the model's reply was empty"
    return "the graph ended without a model reply"


