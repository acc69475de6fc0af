"""FactGuard (paper 1): the reward table, the answer format, the datasets' formats and temporal
split, the metrics, the environment, and the graph's two stages."""

from __future__ import annotations

import asyncio
import json

import pytest

from closedloop.agents.factguard import DecisionReward, parse_verdict
from closedloop.evals.factguard.data import binary_metrics, load_samples, temporal_split
from closedloop.evals.factguard.env import FactGuardEnv
from closedloop.evals.factguard.synthetic import make_synthetic
from closedloop.graphs.factguard import FactGuardContext, graph
from closedloop.messages import AssistantMessage, ImagePart, ToolCall, ToolMessage, UserMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.runtime.convert import as_closedloop, role_of
from closedloop.tool import ToolRegistry
from closedloop.tools.clipscout import make_clipscout_tool
from closedloop.tools.factprobe import LocalCorpus, make_factprobe_tool


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("factguard")
    make_synthetic(root, n=12, seed=1, frames=16)
    return root


# ------------------------------------------------------------------ reward (checkable (a)) and format


def test_reward_table():
    r = DecisionReward(acc=1.0, format=0.5, lam=1.0, alpha=2.0, gamma=3.0, r_plus=0.2, r_minus=0.3)
    right_tool = r.score("fake", "fake", well_formed=True, used_tool=True)
    assert right_tool.acc + right_tool.tool == pytest.approx(1.0 + 0.2) and right_tool.risk == 0
    wrong_tool = r.score("real", "fake", well_formed=True, used_tool=True)
    wrong_bare = r.score("real", "fake", well_formed=True, used_tool=False)
    assert wrong_tool.total < wrong_bare.total and wrong_tool.tool == -0.3
    assert r.score("fake", "real", well_formed=True, used_tool=False).risk == -2.0  # FP costs α
    assert r.score("real", "fake", well_formed=True, used_tool=False).risk == -3.0  # FN costs γ
    assert r.score(None, "fake", well_formed=False, used_tool=False).risk == -3.0  # no answer flags nothing
    assert DecisionReward(lam=0.5, alpha=2.0).score("fake", "real", well_formed=True, used_tool=False).risk == -1.0
    assert r.score("real", "real", well_formed=False, used_tool=False).format == 0.0


def test_answer_format():
    assert parse_verdict("<think>edited</think><answer>fake</answer>").model_dump() == {
        "label": "fake", "well_formed": True, "reasoning": "edited"}
    assert not parse_verdict("<answer>real</answer>").well_formed  # no reasoning
    assert parse_verdict("<answer>real</answer>", reasoning="split off by the backend").well_formed
    assert not parse_verdict("<think>a</think><answer>real</answer><answer>fake</answer>").well_formed
    assert parse_verdict("I think it is fake").label is None


# ------------------------------------------------------------------ data


def test_fakesv_and_fakett_formats_and_the_temporal_split(tmp_path):
    sv = tmp_path / "sv"
    sv.mkdir()
    rows = [{"video_id": f"v{i}", "annotation": a, "title": f"t{i}", "ocr": "o", "keywords": "k",
             "publish_time": 1_600_000_000_000 + i * 86_400_000} for i, a in enumerate(["假", "真", "辟谣", "假"] * 5)]
    (sv / "data_complete.json").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    samples = load_samples(sv)
    assert len(samples) == 15 and {s.label for s in samples} == {"fake", "real"}  # 辟谣 left out
    assert samples[0].dataset == "fakesv" and "t0 o" in samples[0].metadata
    train, test = temporal_split(samples)
    assert len(test) == round(15 * 0.15) and min(s.published for s in test) > max(s.published for s in train)
    tt = tmp_path / "tt"
    tt.mkdir()
    (tt / "data.json").write_text(json.dumps({"video_id": "1", "annotation": "fake", "description": "UFO",
                                              "event": "ufo", "publish_time": "2024-05-01"}) + "\n")
    [s] = load_samples(tt)
    assert (s.label, s.dataset, s.published.year) == ("fake", "fakett", 2024) and "event: ufo" in s.metadata
    (tt / "data.json").write_text(json.dumps({"video_id": "1", "annotation": "maybe"}) + "\n")
    with pytest.raises(ValueError, match="annotation/label fake\\|real"):
        load_samples(tt)
    with pytest.raises(ValueError, match="no samples.jsonl"):
        load_samples(tmp_path)


def test_metrics_match_sklearn():
    from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score

    preds = ["fake", "real", "fake", None, "fake", "real", "real", "fake"]
    labels = ["fake", "fake", "real", "fake", "fake", "real", "real", "real"]
    m = binary_metrics(preds, labels, bootstrap=200)
    y = [int(x == "fake") for x in labels]
    p = [int(x == "fake") for x in preds]
    assert (m.accuracy, m.precision, m.recall, m.f1) == pytest.approx(
        (accuracy_score(y, p), precision_score(y, p), recall_score(y, p), f1_score(y, p)))
    assert m.unanswered == 1 and m.accuracy_ci[0] <= m.accuracy <= m.accuracy_ci[1]
    assert m.f1_ci[0] <= m.f1 <= m.f1_ci[1]


# ------------------------------------------------------------------ environment


def test_environment_episode_with_the_teacher(data):
    env = FactGuardEnv(data_dir=str(data), split="all")

    async def episode(seed):
        msgs, info = await env.areset(seed)
        assert {t["function"]["name"] for t in info["tools"]} == {"factprobe", "clipscout"}
        total, done = 0.0, False
        while not done:
            msgs, r, term, trunc, info = await env.astep(env.expert_action())
            assert sum(info["rewards"].values()) == pytest.approx(r)
            total, done = total + r, term or trunc
        return msgs, info, total

    samples = load_samples(data)
    for seed in range(4):
        msgs, info, total = asyncio.run(episode(seed))
        assert info["sample"] == samples[seed].id  # seeds enumerate the data
        assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "user", "assistant"]
        report, claim = msgs[3].content.lower(), samples[seed].claim.lower()
        decisive = f"false: {claim}" in report or f"confirmed: {claim}" in report
        if decisive:  # the teacher reads a decisive report right
            assert info["success"] == 1.0 and total == pytest.approx(1.0 + 0.5 + 0.2)


def test_calibrated_teacher_is_uncertain_only_where_the_evidence_does_not_settle_the_claim(data):
    """expert_unsettled_fake = p: on an unsettled claim the teacher says "fake" with probability p
    (per episode seed, so passes over the data disagree); settled claims are still read right, and
    the default teacher says "real" whenever nothing settles the claim."""
    samples = load_samples(data)
    opts = dict(data_dir=str(data), split="all", evidence_in_prompt=True, max_turns=1, search_k=1)

    def answers(env, passes):
        out = []
        for seed in range(len(samples) * passes):
            msgs, _ = asyncio.run(env.areset(seed))
            report, claim = msgs[-1].text.lower(), samples[seed % len(samples)].claim.lower()
            settled = f"false: {claim}" in report or f"confirmed: {claim}" in report
            _, _, _, _, info = asyncio.run(env.astep(env.expert_action()))
            out.append((seed % len(samples), settled, info["predicted"], info["label"]))
        return out

    calibrated = answers(FactGuardEnv(**opts, expert_unsettled_fake=0.5), passes=8)
    assert {s for _, s, _, _ in calibrated} == {True, False}  # the fixture has both kinds
    assert all(p == y for _, settled, p, y in calibrated if settled)
    unsettled = [(i, p) for i, settled, p, _ in calibrated if not settled]
    assert 0.3 < sum(p == "fake" for _, p in unsettled) / len(unsettled) < 0.7
    assert any(len({p for j, p in unsettled if j == i}) == 2 for i, _ in unsettled)  # one sample, both answers
    again = answers(FactGuardEnv(**opts, expert_unsettled_fake=0.5), passes=8)
    assert again == calibrated  # seeded by the episode
    default = answers(FactGuardEnv(**opts), passes=1)
    assert all(p == "real" for _, settled, p, _ in default if not settled)
    with pytest.raises(ValueError):
        FactGuardEnv(**opts, expert_unsettled_fake=1.5)


def test_clipscout_once_per_episode_and_frames_for_a_vision_model(data):
    env = FactGuardEnv(data_dir=str(data), split="all", vision=True)

    async def run():
        msgs, _ = await env.areset(0)
        assert isinstance(msgs[1].content, list) and isinstance(msgs[1].content[0], ImagePart)  # overview
        call = ToolCall.make("clipscout", {"start": 0.0, "end": 1.0})
        msgs, r, term, _, _ = await env.astep(AssistantMessage(content="<think>look</think>", tool_calls=[call]))
        assert not term and isinstance(msgs[-2].content[1], ImagePart)  # the grid, then stage 2
        again = ToolCall.make("clipscout", {"start": 1.0, "end": 2.0})
        msgs, *_ = await env.astep(AssistantMessage(content="", tool_calls=[again]))
        refusal = [m for m in msgs if isinstance(m, ToolMessage)][-1]
        assert "once per sample" in refusal.content
        return await env.astep(AssistantMessage(content="<think>x</think><answer>fake</answer>"))

    _, _, term, _, info = asyncio.run(run())
    assert term and info["tools_used"] == ["clipscout", "clipscout"]


# ------------------------------------------------------------------ graph


class RecordingClient(ScriptedClient):
    """Scripted replies, recording which tools each call offered."""

    def __init__(self, script):
        super().__init__(script)
        self.offered: list[list[str]] = []

    async def generate(self, messages, tools=None, params=None, tool_choice=None):
        self.offered.append([t["function"]["name"] for t in tools or []])
        return await super().generate(messages, tools, params, tool_choice)


def sample_tools(data, tmp_path):
    s = load_samples(data)[0]
    return s, ToolRegistry().extend([make_factprobe_tool(LocalCorpus(data / "corpus.duckdb")),
                                     make_clipscout_tool(s.video, out_dir=tmp_path)])


def test_graph_two_stages_tools_only_in_stage_one(data, tmp_path):
    s, tools = sample_tools(data, tmp_path)
    client = RecordingClient([
        AssistantMessage(content="<think>ambiguous</think>", tool_calls=[
            ToolCall.make("factprobe", {"query": s.claim}), ToolCall.make("clipscout", {"start": 0, "end": 1})]),
        AssistantMessage(content="<think>the report settles it</think><answer>fake</answer>")])
    out = asyncio.run(graph.ainvoke({"messages": [UserMessage(content=s.metadata)]},
                                    context=FactGuardContext(client=client, tools=tools)))
    roles = [role_of(m) for m in out["messages"]]
    assert roles == ["user", "assistant", "tool", "tool", "user", "user", "assistant"]  # grid, then stage 2
    assert client.offered == [["factprobe", "clipscout"], []]
    assert isinstance(as_closedloop(out["messages"])[4].content[1], ImagePart)
    assert len(out["turns"]) == 2 and parse_verdict(out["messages"][-1].text).label == "fake"


def test_graph_answers_directly_and_text_models_get_no_image(data, tmp_path):
    s, tools = sample_tools(data, tmp_path)
    direct = RecordingClient([AssistantMessage(content="<think>clear</think><answer>real</answer>")])
    out = asyncio.run(graph.ainvoke({"messages": [UserMessage(content="x")]},
                                    context=FactGuardContext(client=direct, tools=tools)))
    assert [role_of(m) for m in out["messages"]] == ["user", "assistant"] and len(direct.offered) == 1
    client = RecordingClient([
        AssistantMessage(content="", tool_calls=[ToolCall.make("clipscout", {"start": 0, "end": 1})]),
        AssistantMessage(content="<think>y</think><answer>real</answer>")])
    out = asyncio.run(graph.ainvoke({"messages": [UserMessage(content="x")]},
                                    context=FactGuardContext(client=client, tools=tools, attach_frames=False)))
    assert not any(isinstance(m.content, list) for m in out["messages"])


def test_policy_mode_runs_the_stage_the_conversation_is_in(data, tmp_path):
    s, tools = sample_tools(data, tmp_path)
    client = RecordingClient([AssistantMessage(content="", tool_calls=[ToolCall.make("factprobe", {"query": "q"})]),
                              AssistantMessage(content="<think>z</think><answer>real</answer>")])
    context = FactGuardContext(client=client, tools=tools, execute_tools=False)
    first = asyncio.run(graph.ainvoke({"messages": [UserMessage(content="x")]}, context=context))
    assert first["messages"][-1].tool_calls and client.offered[-1] == ["factprobe", "clipscout"]
    convo = first["messages"] + [ToolMessage(content="report", tool_call_id="c1"), UserMessage(content="answer now")]
    second = asyncio.run(graph.ainvoke({"messages": convo}, context=context))
    assert client.offered[-1] == [] and parse_verdict(second["messages"][-1].text).label == "real"


def test_tiny_vlm_runs_the_graph_and_sees_the_video(data, tiny_vlm_path, tmp_path):
    """Mechanics with a real VLM: the overview frames reach the model (recorded as media)."""
    from closedloop.models import SamplingParams, make_client

    env = FactGuardEnv(data_dir=str(data), split="all", vision=True, max_side=56)
    client = make_client(f"hf:{tiny_vlm_path}")

    async def run():
        msgs, info = await env.areset(0)
        context = FactGuardContext(client=client, tools=env.registry, execute_tools=False,
                                   params=SamplingParams(temperature=0, max_tokens=16))
        out = await graph.ainvoke({"messages": msgs}, context=context)
        return out

    out = asyncio.run(run())
    [turn] = out["turns"]
    assert [r.kind for r in turn.media] == ["image"] and turn.prompt_ids and turn.completion_ids


# ------------------------------------------------------------------ evaluation


def reader(messages):
    """A scripted agent that searches once, then answers from the report like the teacher."""
    from closedloop.messages import ToolMessage as TM

    tool_msgs = [m for m in messages if isinstance(m, TM)]
    if not tool_msgs:
        title = messages[-1].text.split("title: ", 1)[1].split(";", 1)[0]
        return AssistantMessage(content="<think>search</think>", tool_calls=[ToolCall.make("factprobe", {"query": title})])
    fake = f"false: {messages[1].text.split('title: ', 1)[1].split(';', 1)[0]}".lower() in tool_msgs[0].content.lower()
    return AssistantMessage(content=f"<think>report</think><answer>{'fake' if fake else 'real'}</answer>")


def test_evaluation_scores_records_and_survives_failures(data, tmp_path):
    from closedloop.evals.factguard.evaluate import evaluate_factguard
    from closedloop.store import RunStore

    samples = load_samples(data)
    store = RunStore(tmp_path / "runs.duckdb")
    backend = LocalCorpus(data / "corpus.duckdb")
    report = evaluate_factguard(samples, ScriptedClient(reader), backend, concurrency=3, store=store)
    assert len(report.results) == len(samples) and report.tool_rate == 1.0
    assert all(r.error is None and r.well_formed for r in report.results)
    # The reader flags exactly the claims with a fact check in the corpus: precision is 1.
    assert report.metrics.precision == 1.0 and report.metrics.fp == 0
    runs = store.list_runs(kind="eval-episode")
    assert len(runs) == len(samples)

    def broken(messages):
        raise RuntimeError("model exploded")

    bad = evaluate_factguard(samples[:3], ScriptedClient(broken), backend, concurrency=2)
    assert bad.metrics.unanswered == 3 and all("model exploded" in r.error for r in bad.results)
    store.close()


def test_cli_runs_the_synthetic_benchmark(tmp_path, tiny_vlm_path):
    import subprocess
    import sys

    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "closedloop", "eval", "factguard", "--data", str(tmp_path / "d"),
                           "--synthetic", "8", "--split", "all", "--limit", "2", "--model", f"hf:{tiny_vlm_path}",
                           "--max-tokens", "8", "--store", str(tmp_path / "s.duckdb"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["metrics"]["n"] == 2 and "accuracy" in proc.stdout


def test_training_configs_close_the_loop(data, tmp_path, tiny_model_path):
    """Teacher episodes recorded by the evaluation are the SFT data the shipped config selects; the
    GRPO config then trains on the factguard environment (one step each here)."""
    from pathlib import Path

    from closedloop.evals.factguard.evaluate import evaluate_factguard
    from closedloop.store import RunStore
    from closedloop.trainers.config import SFTConfig, load_config
    from closedloop.trainers.grpo import GRPOConfig, train_grpo
    from closedloop.trainers.sft import train_sft

    configs = Path(__file__).resolve().parents[3] / "trainers" / "configs"
    store_path = tmp_path / "runs.duckdb"
    store = RunStore(store_path)
    evaluate_factguard(load_samples(data), ScriptedClient(reader), LocalCorpus(data / "corpus.duckdb"), store=store)
    store.close()
    sft_cfg = load_config(SFTConfig, configs / "factguard_sft.yaml",
                          [f"model={tiny_model_path}", f"output_dir={tmp_path / 'sft'}", f"store={store_path}",
                           "max_steps=1", "per_device_batch_size=2", "logging_steps=1", "save_steps=null"])
    sft = train_sft(sft_cfg)
    assert sft.history and (Path(sft.output_dir) / "config.json").exists()
    grpo_cfg = load_config(GRPOConfig, configs / "factguard_grpo.yaml",
                           [f"model={sft.output_dir}", f"output_dir={tmp_path / 'grpo'}", f"store={store_path}",
                            "max_steps=1", "num_generations=2", "prompts_per_step=2", "logging_steps=1",
                            "save_steps=null"])
    grpo_cfg = grpo_cfg.model_copy(update={"env_options": {**grpo_cfg.env_options, "data_dir": str(data)}})
    grpo = train_grpo(grpo_cfg)
    assert grpo.history and {"rewards/acc", "rewards/risk"} <= set(grpo.history[0])
