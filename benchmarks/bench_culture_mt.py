"""CULTURE-MT metrics and judge loop (closedloop.tools.culture_mt) against direct sacrebleu / a bare loop.

* metrics: our corpus BLEU + chrF and per-note sentence BLEU + chrF vs the same sacrebleu calls made
  directly, on the sample notes repeated to the benchmark's size (1,002 notes); scores must match,
  so the ratio is our loading/validation overhead.
* judge: judge_notes with a zero-latency scripted judge vs a bare loop that calls the same client and
  json.loads the reply: the framework's per-note overhead (prompting, parsing, validation).

    python benchmarks/bench_culture_mt.py [--notes 1002] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import sacrebleu

from closedloop.messages import AssistantMessage, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.tools.culture_mt import corpus_scores, judge_notes, load_hypotheses, load_notes, sentence_scores
from _timing import best_time_and_result as best_time

DATA = Path(__file__).resolve().parents[1] / "tests" / "tools" / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notes", type=int, default=1002)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = load_notes(DATA / "culture_mt_sample.jsonl")
    hyps0 = load_hypotheses(DATA / "culture_mt_sample_literal.jsonl", base)
    reps = -(-args.notes // len(base))
    notes = [n.model_copy(update={"id": f"{n.id}-{k}"}) for k in range(reps) for n in base][: args.notes]
    hyps = (hyps0 * reps)[: args.notes]
    refs = [n.reference for n in notes]

    def ours():
        return corpus_scores(notes, hyps), sentence_scores(notes, hyps)

    def direct():
        c = (sacrebleu.corpus_bleu(hyps, [refs]).score, sacrebleu.corpus_chrf(hyps, [refs]).score)
        return c, ([sacrebleu.sentence_bleu(h, [r]).score for h, r in zip(hyps, refs)],
                   [sacrebleu.sentence_chrf(h, [r]).score for h, r in zip(hyps, refs)])

    t_ref, (c_ref, s_ref) = best_time(direct, args.repeats)
    t_ours, (c_ours, s_ours) = best_time(ours, args.repeats)
    diff = max(abs(c_ours["bleu"] - c_ref[0]), abs(c_ours["chrf"] - c_ref[1]),
               max(abs(a - b) for a, b in zip(s_ours[0] + s_ours[1], s_ref[0] + s_ref[1])))
    print(f"metrics, {len(notes)} notes: sacrebleu direct {t_ref:.3f} s, ours {t_ours:.3f} s, "
          f"ratio {t_ours / t_ref:.2f}, max|diff| {diff:.1e}")

    reply = AssistantMessage(content='{"accuracy": 4, "adaptability": 3, "rationale": "ok"}')

    async def bare():
        client = ScriptedClient([reply], cycle=True)
        out = []
        for n, h in zip(notes, hyps):
            turn = await client.generate([UserMessage(content=f"{n.source}\n{h}")])
            out.append(json.loads(turn.message.text))
        return out

    async def framework():
        return await judge_notes(ScriptedClient([reply], cycle=True), notes, hyps, concurrency=8)

    t_bare, _ = best_time(lambda: asyncio.run(bare()), args.repeats)
    t_fw, js = best_time(lambda: asyncio.run(framework()), args.repeats)
    assert all(j.effectiveness == 3.5 for j in js)
    print(f"judge loop, {len(notes)} notes (zero-latency judge): bare loop {t_bare:.3f} s, judge_notes {t_fw:.3f} s, "
          f"ratio {t_fw / t_bare:.2f}, overhead {1e6 * (t_fw - t_bare) / len(notes):.0f} us/note")


if __name__ == "__main__":
    main()
