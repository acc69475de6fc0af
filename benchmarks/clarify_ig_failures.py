"""Where the sampled policies of ``bench_clarify_ig.py`` lose success: failure modes per episode.

Re-evaluates the saved final policies of both arms (``grpo-success-s*``, ``grpo-ig-group-exclude-s*``)
on the benchmark's 200 held-out seeds with its sampling seed, so success equals the benchmark's
table, and sorts every episode: success; a wrong id (goal identified or a guess); or no valid
submit within the turn budget (goal identified by the answers, or not).

    python benchmarks/clarify_ig_failures.py out/clarify-ig2/cost '{}'
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from recipes.clarify_ig import TINY_TASK  # noqa: E402

from closedloop.evals.envs import make_env  # noqa: E402
from closedloop.models.base import SamplingParams  # noqa: E402
from closedloop.models.hf import HFClient  # noqa: E402
from closedloop.trainers.evaluate import evaluate  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    out, opts = Path(sys.argv[1]), {**TINY_TASK, **json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")}
    seeds = range(10_000_000, 10_000_200)
    for seed in (0, 1, 2):
        for arm in ("success", "ig-group-exclude"):
            path = out / f"grpo-{arm}-s{seed}"
            if not path.is_dir():
                continue
            client = HFClient.from_pretrained(path, max_batch_size=64)
            summary, episodes = evaluate(client, lambda: make_env("clarify", **opts), seeds, name=arm,
                                         params=SamplingParams(temperature=1.0, max_tokens=64, seed=seed),
                                         max_steps=make_env("clarify", **opts)._max_turns())
            modes: Counter[str] = Counter()
            for e in episodes:
                identified = e.info["remaining"] == 1
                if e.info["success"]:
                    modes["success"] += 1
                elif e.info["submitted"] is not None:
                    modes["wrong id, goal identified" if identified else "wrong id, a guess"] += 1
                else:
                    modes["no valid submit, goal identified" if identified else "no valid submit, not identified"] += 1
            print(seed, arm, f"{summary.success_rate:.3f}", dict(sorted(modes.items())), flush=True)


if __name__ == "__main__":
    main()
