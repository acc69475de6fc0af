"""``closedloop eval factguard``: run an agent graph on every sample of a FactGuard dataset.

Each sample gets its own tools (``factprobe`` over the dataset's corpus or a configured web
backend; ``clipscout`` on its video, once), the graph runs them itself (``execute_tools=True``),
and the verdict is read from the last answer. Samples run concurrently (``concurrency``), each
with a timeout; a failure is recorded with its error and scored as unanswered, never dropped.
Every episode is recorded in the run store as a trajectory (parent run: the evaluation), and the
metrics (Acc/P/R/F1 with intervals, tool use) go to the parent's outcome and a JSON file.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from closedloop.agents.factguard import DecisionReward, parse_verdict, sample_prompt
from closedloop.evals.factguard.data import BinaryMetrics, Sample, binary_metrics
from closedloop.evals.factguard.env import overview_image, transcribe
from closedloop.messages import AssistantMessage, ImagePart, TextPart, Trajectory, UserMessage
from closedloop.models.base import ModelClient, SamplingParams
from closedloop.runtime import check_graph, context_for, load_graph
from closedloop.runtime.convert import as_closedloop
from closedloop.tool import ToolRegistry
from closedloop.tools.clipscout import make_clipscout_tool
from closedloop.tools.factprobe import SearchBackend, make_factprobe_tool

__all__ = ["SampleResult", "FactGuardReport", "aevaluate_factguard", "evaluate_factguard"]


class SampleResult(BaseModel):
    id: str
    label: str
    predicted: str | None
    well_formed: bool
    tools_used: list[str]
    reward: float
    seconds: float
    error: str | None = None


class FactGuardReport(BaseModel):
    metrics: BinaryMetrics
    results: list[SampleResult]
    tool_rate: float
    samples_per_minute: float
    concurrency: int
    graph: str
    model: str


async def aevaluate_factguard(samples: list[Sample], client: ModelClient, backend: SearchBackend, *,
                              graph: str | Any = "factguard", vision: bool = False,
                              params: SamplingParams | None = None, concurrency: int = 4, timeout_s: float = 300.0,
                              reward: DecisionReward | None = None, store: Any = None, name: str | None = None,
                              on_result: Callable[[SampleResult], None] | None = None,
                              max_side: int = 448, asr: str | None = None) -> FactGuardReport:
    """Evaluate ``graph`` on ``client`` over ``samples``; see the module docstring."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    compiled_graph = load_graph(graph) if isinstance(graph, str) else check_graph(graph)
    graph_name = graph if isinstance(graph, str) else compiled_graph.name
    reward = reward or DecisionReward()
    params = params or SamplingParams(temperature=0.0, max_tokens=512)
    sem = asyncio.Semaphore(concurrency)
    tmp = tempfile.TemporaryDirectory(prefix="closedloop-factguard-eval-")
    parent = None
    if store is not None:
        parent = store.start_run(kind="eval", graph=graph_name, model_spec=client.spec,
                                 config={"benchmark": "factguard", "n": len(samples), "vision": vision},
                                 tags=["factguard"] + ([f"name:{name}"] if name else []))
    trajectories: list[Trajectory] = []

    async def one(s: Sample) -> SampleResult:
        async with sem:
            t0 = time.perf_counter()
            tools = ToolRegistry().extend([make_factprobe_tool(backend)])
            if s.video:
                tools.register(make_clipscout_tool(s.video, out_dir=tmp.name, max_side=max_side))
            transcript = s.transcript
            if transcript is None and asr and s.video:  # the ASR expert fills a missing transcript
                transcript = await asyncio.to_thread(transcribe, s.video, asr)
            text = sample_prompt(s.metadata, transcript)
            if vision and s.video:
                path, video = Path(tmp.name) / f"overview-{s.id}.png", s.video
                await asyncio.to_thread(lambda: overview_image(video, max_side).save(path))
                user = UserMessage(content=[ImagePart.from_path(path), TextPart(text=text)])
            else:
                user = UserMessage(content=text)
            try:
                context = context_for(compiled_graph, client=client, tools=tools, params=params, attach_frames=vision)
                out = await asyncio.wait_for(compiled_graph.ainvoke({"messages": [user]}, context=context), timeout_s)
            except Exception as e:  # scored as unanswered, recorded with its reason
                r = reward.score(None, s.label, well_formed=False, used_tool=False)
                return SampleResult(id=s.id, label=s.label, predicted=None, well_formed=False, tools_used=[],
                                    reward=r.total, seconds=time.perf_counter() - t0,
                                    error=f"{type(e).__name__}: {e}"[:500])
            messages = as_closedloop(out.get("messages", []))
            last = next((m for m in reversed(messages) if isinstance(m, AssistantMessage)), None)
            verdict = parse_verdict(last.text if last else None, last.reasoning if last else None)
            used = [r.name for r in out.get("tool_records", [])]
            r = reward.score(verdict.label, s.label, well_formed=verdict.well_formed, used_tool=bool(used))
            trajectories.append(Trajectory(messages=messages, turns=list(out.get("turns", [])),
                                           rewards=r.components(),
                                           metadata={"sample": s.id, "label": s.label, "predicted": verdict.label}))
            return SampleResult(id=s.id, label=s.label, predicted=verdict.label, well_formed=verdict.well_formed,
                                tools_used=used, reward=r.total, seconds=time.perf_counter() - t0)

    async def tracked(s: Sample) -> SampleResult:
        res = await one(s)
        if on_result is not None:
            on_result(res)
        return res

    t0 = time.perf_counter()
    try:
        results = list(await asyncio.gather(*(tracked(s) for s in samples)))
    finally:
        tmp.cleanup()
    elapsed = time.perf_counter() - t0
    metrics = binary_metrics([r.predicted for r in results], [r.label for r in results])  # type: ignore[misc]
    report = FactGuardReport(metrics=metrics, results=results,
                             tool_rate=sum(bool(r.tools_used) for r in results) / max(1, len(results)),
                             samples_per_minute=60 * len(results) / max(elapsed, 1e-9), concurrency=concurrency,
                             graph=graph_name, model=client.spec)
    if store is not None and parent is not None:
        store.record_trajectories(trajectories, kind="eval-episode", graph=graph_name, model_spec=client.spec,
                                  parent_id=parent, tags=["factguard"])
        errors = sum(r.error is not None for r in results)
        answered = metrics.n - metrics.unanswered
        # Nothing answered: no metric is stored (they would be the unanswered convention's numbers).
        store.finish_run(parent, "completed", outcome={**({"metrics": metrics.model_dump()} if answered else {}),
                                                       "answered": answered, "errors": errors,
                                                       "tool_rate": report.tool_rate})
    return report


def evaluate_factguard(*args: Any, **kwargs: Any) -> FactGuardReport:
    return asyncio.run(aevaluate_factguard(*args, **kwargs))
