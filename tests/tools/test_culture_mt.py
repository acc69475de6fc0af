"""CULTURE-MT: note loader, rubric judge over a ModelClient, sacrebleu metrics, BLEU-vs-judge rank correlation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sacrebleu

from closedloop.messages import AssistantMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.tool import ToolRegistry
from closedloop.tools.culture_mt import (
    TOOLS,
    check_full_benchmark,
    corpus_scores,
    judge_notes,
    load_hypotheses,
    load_notes,
    parse_judgment,
    rank_correlation,
    sentence_scores,
)

DATA = Path(__file__).parent / "data"
SAMPLE = DATA / "culture_mt_sample.jsonl"
LITERAL, ADAPTED = DATA / "culture_mt_sample_literal.jsonl", DATA / "culture_mt_sample_adapted.jsonl"


def reply(text: str) -> AssistantMessage:
    return AssistantMessage(content=text)


def gold_judge() -> ScriptedClient:
    """A deterministic judge standing in for human ratings: word-for-word calques score low on adaptability,
    adapted renderings high (the labels come from which system produced the hypothesis)."""
    adapted = {json.loads(line)["hypothesis"] for line in ADAPTED.read_text().splitlines()}

    def rate(messages):
        hyp = messages[-1].text.split("Translation to evaluate (en):\n", 1)[1]
        acc, ada = (5, 5) if hyp in adapted else (3, 2)
        return reply(f'Here is my assessment.\n{{"accuracy": {acc}, "adaptability": {ada}, "rationale": "r"}}')

    return ScriptedClient(rate, name="gold")


def test_sample_loads_with_counts_by_domain_and_type():
    notes = load_notes(SAMPLE)
    assert len(notes) == 12
    assert {n.domain for n in notes} == {"food", "travel", "beauty"}
    assert sorted({n.type for n in notes}) == ["plain+slang", "plain+standard", "symbol+slang", "symbol+standard"]
    assert all(n.src_lang == "zh" and n.tgt_lang == "en" and n.reference for n in notes)
    assert notes[0].culture_items == ["家人们谁懂啊", "yyds", "上头"]


def _write(path: Path, n: int, domains: int, types: int) -> Path:
    path.write_text("\n".join(json.dumps({"id": i, "domain": f"d{i % domains}", "type": f"t{i % types}", "source": "x"})
                              for i in range(n)))
    return path


def test_full_benchmark_shape_is_1002_notes_14_domains_4_types(tmp_path):
    check_full_benchmark(load_notes(_write(tmp_path / "full.jsonl", 1002, 14, 4)))
    with pytest.raises(ValueError, match=r"notes 1001 \(expected 1002\)"):
        check_full_benchmark(load_notes(_write(tmp_path / "a.jsonl", 1001, 14, 4)))
    with pytest.raises(ValueError, match=r"domains 13 \(expected 14\).*types 3 \(expected 4\)"):
        check_full_benchmark(load_notes(_write(tmp_path / "b.jsonl", 1002, 13, 3)))


def test_loader_accepts_aliases_and_rejects_bad_records(tmp_path):
    p = tmp_path / "alias.json"
    p.write_text(json.dumps({"notes": [{"note_id": 7, "category": "food", "note_type": "t", "src": "源", "ref": "ref"}]}))
    (n,) = load_notes(p)
    assert (n.id, n.domain, n.type, n.source, n.reference) == ("7", "food", "t", "源", "ref")
    q = tmp_path / "mapped.jsonl"
    q.write_text(json.dumps({"id": "a", "field": "food", "kind": "t", "zh": "源"}))
    assert load_notes(q, field_map={"field": "domain", "kind": "type", "zh": "source"})[0].source == "源"
    dup = tmp_path / "dup.jsonl"
    dup.write_text("\n".join([json.dumps({"id": "a", "domain": "d", "type": "t", "source": "s"})] * 2))
    with pytest.raises(ValueError, match="duplicate id 'a'"):
        load_notes(dup)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "domain": "d", "type": "t", "source": "s"}) + "\n{oops\n")
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_notes(bad)
    lacking = tmp_path / "lacking.jsonl"
    lacking.write_text(json.dumps({"id": "a", "domain": "d", "source": "  "}))
    with pytest.raises(ValueError, match="record 1 is not a valid note.*type.*source"):
        load_notes(lacking)
    with pytest.raises(ValueError, match="not found"):
        load_notes(tmp_path / "none.jsonl")
    (tmp_path / "notes.csv").write_text("id,domain\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_notes(tmp_path / "notes.csv")


def test_hypotheses_align_by_id_or_by_line(tmp_path):
    notes = load_notes(SAMPLE)
    recs = [json.loads(line) for line in LITERAL.read_text().splitlines()]
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in reversed(recs)))
    hyps = load_hypotheses(shuffled, notes)
    assert hyps == [r["hypothesis"] for r in recs]
    txt = tmp_path / "hyps.txt"
    txt.write_text("\n".join(hyps) + "\n")
    assert load_hypotheses(txt, notes) == hyps
    txt.write_text("\n".join(hyps[:-1]))
    with pytest.raises(ValueError, match="11 lines for 12 notes"):
        load_hypotheses(txt, notes)
    shuffled.write_text("\n".join(json.dumps(r) for r in recs[1:]))
    with pytest.raises(ValueError, match="no hypothesis for 1 note.*n01"):
        load_hypotheses(shuffled, notes)


def test_bleu_and_chrf_are_sacrebleus():
    notes, hyps = load_notes(SAMPLE), load_hypotheses(LITERAL, load_notes(SAMPLE))
    refs = [n.reference for n in notes]
    got = corpus_scores(notes, hyps)
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert got["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
    assert "tok:13a" in got["bleu_signature"]
    perfect = corpus_scores(notes, refs)
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
    sb, sc = sentence_scores(notes, hyps)
    assert sb[3] == pytest.approx(sacrebleu.sentence_bleu(hyps[3], [refs[3]]).score)
    assert sc[3] == pytest.approx(sacrebleu.sentence_chrf(hyps[3], [refs[3]]).score)
    zh = [n.model_copy(update={"tgt_lang": "zh"}) for n in notes]
    assert "tok:zh" in corpus_scores(zh, hyps)["bleu_signature"]
    with pytest.raises(ValueError, match="need references"):
        corpus_scores([notes[0].model_copy(update={"reference": None})], ["x"])


def test_parse_judgment_takes_the_last_rubric_object_and_refuses_out_of_range():
    s = parse_judgment('Reasoning {"draft": 1} ... final: {"accuracy": 4, "adaptability": 2, "rationale": "ok"}')
    assert (s.accuracy, s.adaptability) == (4, 2)
    with pytest.raises(ValueError, match="range"):
        parse_judgment('{"accuracy": 7, "adaptability": 2}')
    with pytest.raises(ValueError, match="no JSON object"):
        parse_judgment("The translation is good. 5/5")


async def test_judge_records_failures_instead_of_inventing_scores():
    notes = load_notes(SAMPLE)[:4]
    script = [reply('{"accuracy": 5, "adaptability": 3}'), reply("I would give it a 4."),
              reply('{"accuracy": 0, "adaptability": 3}'), reply('```json\n{"accuracy": 2, "adaptability": 4}\n```')]
    js = await judge_notes(ScriptedClient(script), notes, ["h"] * 4, accuracy_weight=0.25, concurrency=1)
    assert [j.effectiveness for j in js] == [3.5, None, None, 3.5]
    assert "no JSON object" in js[1].error and js[1].raw == "I would give it a 4." and "range" in js[2].error

    class Broken(ScriptedClient):
        async def generate(self, *a, **k):
            raise ConnectionError("server down")

    (j,) = await judge_notes(Broken([]), notes[:1], ["h"])
    assert j.effectiveness is None and "ConnectionError: server down" in j.error


async def test_judge_is_reference_free_unless_asked():
    notes = load_notes(SAMPLE)[:1]
    client = ScriptedClient([reply('{"accuracy": 5, "adaptability": 5}')], cycle=True)
    await judge_notes(client, notes, ["hyp"])
    await judge_notes(client, notes, ["hyp"], include_reference=True)
    free, with_ref = client.calls[0][-1].text, client.calls[1][-1].text
    assert notes[0].source in free and "hyp" in free and notes[0].reference not in free
    assert notes[0].reference in with_ref
    assert "Cultural adaptability" in client.calls[0][0].text  # the rubric is the system prompt


def test_rank_correlation_known_values_ties_and_gaps():
    c = rank_correlation([1, 2, 3, 4], [1, 3, 2, 4])
    assert c.spearman == pytest.approx(0.8) and c.kendall_tau_b == pytest.approx(4 / 6)
    assert rank_correlation([1, 2, 3], [30, 20, 10]).spearman == pytest.approx(-1.0)
    gaps = rank_correlation([1, 2, None, 3, 4], [1, 3, 5, 2, 4])  # a failed judgment is left out, not zeroed
    assert gaps.n == 4 and gaps.spearman == pytest.approx(0.8)
    ties = rank_correlation([1, 1, 2, 2], [1, 2, 3, 4])  # tau-b: 4 concordant / sqrt((6 - 2 x-ties) * 6)
    assert ties.kendall_tau_b == pytest.approx(4 / 24 ** 0.5)
    assert rank_correlation([1, 2, 3], [2, 2, 2]).spearman is None
    assert "at least 3" in rank_correlation([1, 2], [1, 2]).note
    with pytest.raises(ValueError, match="NaN"):
        rank_correlation([1, 2, float("nan")], [1, 2, 3])


async def test_bleu_ranks_literal_calques_above_adapted_translations_the_judge_prefers():
    """The paper's claim in miniature: surface overlap with a reference rewards word-for-word translation
    of culture-loaded notes, so BLEU and a cultural judge disagree (here by construction of the ratings)."""
    notes = load_notes(SAMPLE)
    lit, ada = load_hypotheses(LITERAL, notes), load_hypotheses(ADAPTED, notes)
    assert corpus_scores(notes, lit)["bleu"] > corpus_scores(notes, ada)["bleu"]
    both_notes, both_hyps = notes + notes, lit + ada
    js = await judge_notes(gold_judge(), both_notes, both_hyps)
    assert all(j.error is None for j in js)
    bleu, _ = sentence_scores(both_notes, both_hyps)
    corr = rank_correlation(bleu, [j.effectiveness for j in js])
    effectiveness = {name: sum(j.effectiveness for j in js[k * 12:(k + 1) * 12]) / 12 for k, name in enumerate(["lit", "ada"])}
    assert effectiveness["ada"] > effectiveness["lit"]  # the system ranking inverts
    # per note, BLEU carries no significant signal about the judge (the paper's "low rank correlation")
    assert corr.n == 24 and abs(corr.spearman) < 0.3 and corr.spearman_p > 0.05


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOSEDLOOP_ARTIFACTS", str(tmp_path / "artifacts"))
    return ToolRegistry().extend(TOOLS)


async def test_tools_count_score_judge_and_correlate(registry, tmp_path, monkeypatch):
    rep = json.loads((await registry.call_json("culture_mt_notes", json.dumps({"notes_path": str(SAMPLE)}))).content)
    assert rep["notes"] == 12 and rep["types"]["symbol+slang"] == 3 and rep["language_pairs"] == {"zh-en": 12}
    full = await registry.call_json("culture_mt_notes", json.dumps({"notes_path": str(SAMPLE), "check_full": True}))
    assert not full.ok and "notes 12 (expected 1002)" in full.error
    m = json.loads((await registry.call_json("culture_mt_metrics", json.dumps(
        {"notes_path": str(SAMPLE), "hypotheses_path": str(LITERAL)}))).content)
    assert m["n"] == 12 and set(m["bleu_by_type"]) == {"plain+slang", "plain+standard", "symbol+slang", "symbol+standard"}
    # the judge tool builds its client from the spec; serve the scripted gold judge under a spec
    built = []
    monkeypatch.setattr("closedloop.models.make_client", lambda spec: built.append(spec) or gold_judge())
    args = {"notes_path": str(SAMPLE), "hypotheses_path": str(ADAPTED), "judge_model": "openai:gold"}
    refused = await registry.call_json("culture_mt_judge", json.dumps(args))
    assert refused.error_kind == "invalid_arguments" and "operator allows" in refused.error and built == []
    monkeypatch.setenv("CLOSEDLOOP_TOOL_MODELS", "openai:gold")  # an endpoint the operator allows
    j = await registry.call_json("culture_mt_judge", json.dumps(args))
    assert j.ok, j.error
    jr = json.loads(j.content)
    assert jr["judged"] == 12 and jr["failed"] == 0 and jr["effectiveness_mean"] == 5.0
    assert jr["bleu_vs_judge"]["note"].startswith("one of the score lists is constant")
    lines = Path(jr["judgments_path"]).read_text().splitlines()
    assert len(lines) == 12 and json.loads(lines[0])["sentence_bleu"] > 0
    by_type = json.loads((await registry.call_json("culture_mt_correlation", json.dumps(
        {"judgments_path": jr["judgments_path"], "metric": "sentence_chrf", "by": "type"}))).content)
    assert set(by_type) == {"plain+slang", "plain+standard", "symbol+slang", "symbol+standard"}
    missing = await registry.call_json("culture_mt_metrics", json.dumps(
        {"notes_path": str(SAMPLE), "hypotheses_path": str(tmp_path / "none.jsonl")}))
    assert not missing.ok and "not found" in missing.error
    bad = await registry.call_json("culture_mt_judge", json.dumps(
        {"notes_path": str(SAMPLE), "hypotheses_path": str(ADAPTED), "judge_model": "x", "accuracy_weight": 2}))
    assert not bad.ok and bad.error_kind == "invalid_arguments"


@pytest.mark.slow
async def test_judge_tool_runs_a_real_hf_model_and_reports_unparseable_replies(registry, tiny_model_path):
    """The tiny local model cannot follow the rubric: every reply must be a recorded failure, none a score."""
    res = await registry.call_json("culture_mt_judge", json.dumps(
        {"notes_path": str(SAMPLE), "hypotheses_path": str(LITERAL), "judge_model": f"hf:{tiny_model_path}",
         "max_notes": 1, "max_tokens": 16}))
    assert res.ok, res.error
    rep = json.loads(res.content)
    assert rep["n"] == 1 and rep["judged"] + rep["failed"] == 1
    if rep["failed"]:
        assert rep["first_error"]
    if rep["judged"] == 0:
        assert rep["effectiveness_mean"] is None and rep["bleu_vs_judge"]["n"] == 0
