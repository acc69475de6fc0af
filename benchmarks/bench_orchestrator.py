"""Orchestration (paper 4): latency and expert calls per question against one model answering alone,
and barge-in cancel latency, in one run.

A small multimodal QA set: ``--images`` pictures, each asked ``--repeats`` times (the same question
reworded by case and punctuation, as a user repeats themself). The orchestrator's controller is
scripted (routing costs nothing, so the figures isolate the experts and the memory); its vision
expert is the tiny VLM. The baseline is the same VLM answering every question alone. Barge-in:
``--barge`` answers are interrupted after a random number of chunks; p50/p95 of the time from the
interruption to playback stopped.

    python benchmarks/bench_orchestrator.py --vlm /path/to/tiny-vlm      # or it builds one (needs --text-model)
"""

from __future__ import annotations

import argparse
import asyncio
import io
import random
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vlm", help="a VLM checkpoint dir (default: build the tiny VLM from --text-model)")
    ap.add_argument("--text-model", help="tiny text model dir to build the VLM from")
    ap.add_argument("--images", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--barge", type=int, default=30)
    args = ap.parse_args()

    import numpy as np
    import torch
    from PIL import Image

    from closedloop.agents.orchestrator.experts import ExpertPool, OrchestratorConfig
    from closedloop.agents.orchestrator.interaction import Player, Session, ToneTTS
    from closedloop.graphs.orchestrator import OrchestratorContext, graph
    from closedloop.messages import AssistantMessage, ImagePart, TextPart, UserMessage
    from closedloop.models import SamplingParams, make_client
    from closedloop.models.scripted import ScriptedClient

    torch.set_num_threads(1)
    vlm = args.vlm
    if vlm is None:
        if not args.text_model:
            ap.error("give --vlm or --text-model")
        from closedloop.models.tiny_vlm import build_tiny_vlm

        vlm = str(build_tiny_vlm(Path(tempfile.mkdtemp()) / "vlm", args.text_model))
    client = make_client(f"hf:{vlm}")
    pictures = []
    for i in range(args.images):
        buf = io.BytesIO()
        Image.fromarray((np.random.default_rng(i).random((48, 48, 3)) * 255).astype("uint8")).save(buf, "PNG")
        pictures.append(buf.getvalue())
    variants = ["What is in this picture?", "what is in this picture", "What is in this picture ?"]
    questions = [(p, variants[r % len(variants)]) for p in pictures for r in range(args.repeats)]
    random.Random(0).shuffle(questions)

    def reply(msgs):
        last = msgs[-1].text
        if last.startswith("Expert results:"):
            return AssistantMessage(content=f"<speak>{last.split('-> ', 1)[1] or 'unknown'}</speak>")
        return AssistantMessage(content='<call expert="vision" source="image:0">What is in this picture?</call>')

    cfg = OrchestratorConfig.model_validate({"experts": {"vision": {"kind": "model", "model": f"hf:{vlm}",
                                                                    "modality": "image", "max_tokens": 16}}})
    pool = ExpertPool(cfg, clients={"vision": client})
    context = OrchestratorContext(client=ScriptedClient(reply), experts=pool)

    async def run_orchestrated() -> list[float]:
        lat = []
        for data, q in questions:
            t0 = time.perf_counter()
            await graph.ainvoke({"messages": [UserMessage(content=[TextPart(text=q), ImagePart.from_bytes(data)])],
                                 "scratch": {}}, context=context)
            lat.append(time.perf_counter() - t0)
        return lat

    async def run_alone() -> list[float]:
        lat = []
        for data, q in questions:
            t0 = time.perf_counter()
            await client.generate([UserMessage(content=[TextPart(text=q), ImagePart.from_bytes(data)])],
                                  params=SamplingParams(temperature=0, max_tokens=16))
            lat.append(time.perf_counter() - t0)
        return lat

    alone = asyncio.run(run_alone())
    orch = asyncio.run(run_orchestrated())

    async def barge() -> list[float]:
        rng = random.Random(1)
        out = []
        long = ScriptedClient(lambda m: AssistantMessage(content="<speak>" + "a long spoken answer " * 10 + "</speak>"))
        session = Session(graph, OrchestratorContext(client=long, experts=pool), tts=ToneTTS(), player=Player(chunk_ms=20))
        for _ in range(args.barge):
            await session.ask("talk")
            target = rng.randrange(1, 20)
            while session.player.played < target:
                await asyncio.sleep(0.002)
            out.append(await session.barge_in())
        return out

    cancels = asyncio.run(barge())
    q = statistics.quantiles(cancels, n=20)
    n = len(questions)
    print(f"{n} questions ({args.images} images x {args.repeats} askings)")
    print(f"{'':14s} {'mean s/question':>16s} {'model calls/question':>22s}")
    print(f"{'VLM alone':14s} {statistics.mean(alone):16.4f} {1.0:22.2f}")
    print(f"{'orchestrated':14s} {statistics.mean(orch):16.4f} {pool.calls['vision'] / n:22.2f}"
          f"   (memory hits {n - pool.calls['vision']})")
    print(f"latency ratio orchestrated/alone: {statistics.mean(orch) / statistics.mean(alone):.2f}x")
    print(f"barge-in cancel latency over {len(cancels)} interruptions: p50 {statistics.median(cancels) * 1000:.2f} ms, "
          f"p95 {q[18] * 1000:.2f} ms (chunk 20 ms)")


if __name__ == "__main__":
    main()
