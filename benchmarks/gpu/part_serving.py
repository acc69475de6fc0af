"""Part ``serving``: ``closedloop serve`` with the model part's checkpoint on the GPU against
``transformers serve --continuous-batching`` on the same GPU, at 1, 8 and 32 concurrent clients:
``benchmarks/bench_serve.py`` (both servers are real CLIs in subprocesses, driven by the same
aiohttp load generator with greedy decoding and the same ``max_tokens``; its docstring says what
is matched), with ``--device cuda``, one round (a lent GPU has minutes) of 64 requests of 16
tokens per level. A dry run does the same on the CPU with the toy model and a few requests, the
peer's paged cache capped and closedloop's decoder on the server's thread (``DRY``).
"""

from __future__ import annotations

import argparse
import json

from common import Recorder, part_main
from part_model import model_dir
from report import table

GPU = ["--requests", "64", "--max-tokens", "16", "--repeat", "1", "--concurrency", "1", "8", "32"]
#: the dry run caps the peer's paged cache (sized from a CPU machine's memory it costs tens of
#: seconds of page faults: bench_serve.py --peer-kv-blocks) and runs closedloop's decoder on the
#: server's thread (one process fewer to start; the engine process is CI-tested in tests/server)
DRY = ["--requests", "4", "--max-tokens", "4", "--repeat", "1", "--concurrency", "1", "8", "32",
       "--peer-kv-blocks", "64", "--engine", "thread"]


def run(rec: Recorder, args: argparse.Namespace) -> str:
    import torch

    import bench_serve

    model = model_dir(args.work)
    if not (model / "config.json").is_file():
        rec.skip("serving", "the model part left no checkpoint")
        return "failed"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.work / "serve.json"
    argv = ["--model", str(model), "--device", device, "--json", str(out)] + (DRY if args.dry_run else GPU)
    rec.set("command", "python benchmarks/bench_serve.py " + " ".join(argv))
    code = bench_serve.main(argv)
    data = json.loads(out.read_text())
    levels = []
    for ours, peer in zip(data["closedloop"], data["peer"] or []):
        levels.append({"clients": ours["concurrency"], "closedloop_rps": ours["rps"], "peer_rps": peer["rps"],
                       "closedloop_tps": ours["tps"], "peer_tps": peer["tps"], "ratio_rps": ours["rps"] / peer["rps"],
                       "closedloop_mean_rows": ours.get("mean_rows")})
    rec.set("levels", levels)
    rec.set("prompt_cache", data.get("prompt_cache"))
    rec.summary(table(["clients", "closedloop req/s", "transformers serve req/s", "ratio", "closedloop tok/s",
                       "mean rows per decode step"],
                      [[x["clients"], x["closedloop_rps"], x["peer_rps"], x["ratio_rps"], x["closedloop_tps"],
                        x["closedloop_mean_rows"]] for x in levels]))
    return "ok" if code == 0 and len(levels) == 3 else "failed"


if __name__ == "__main__":
    part_main("serving", run)
