"""Batch KernelBench evaluation: candidate files through the CLI, store records, resume, refusal,
export, and an agent graph (``kernel``, scripted model) through the runner."""

from __future__ import annotations

import asyncio
import json

import pytest

from closedloop.cli import main
from closedloop.evals.kernelbench.metrics import fast_p, geomean_speedup, pass_at_k
from closedloop.evals.kernelbench.evaluate import KernelResult
from closedloop.evals.kernelbench.runner import KernelBenchRunner, KernelBenchSettings, graph_agent
from closedloop.messages import AssistantMessage
from closedloop.models.scripted import ScriptedClient
from closedloop.store import RunStore

from .conftest import PROBLEMS, RELU_OK


def test_metrics_follow_kernelbench():
    def r(problem: str, status: str, speedup: float | None, sample: int = 0, unstable: bool = False) -> KernelResult:
        return KernelResult(problem=problem, level=1, problem_id=1, sample_id=sample, backend="cpu", scale=1.0,
                            status=status, speedup=speedup, timed=speedup is not None, timing_unstable=unstable)

    res = [r("a", "correct", 1.2), r("b", "correct", 0.9), r("c", "incorrect", None), r("d", "suspicious", 50.0)]
    assert fast_p(res, 0.0) == 0.5 and fast_p(res, 1.0) == 0.25 and fast_p(res, 1.2) == 0.0  # strict >
    assert fast_p(res, 1.0, reviewed={("d", 0)}) == 0.5  # a reviewed suspicious sample counts
    assert geomean_speedup(res) == pytest.approx((1.2 * 0.9) ** 0.5)
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0 and pass_at_k(4, 2, 1) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    # a speedup too noisy to credit counts as correct, never as fast
    noisy = [r("a", "correct", 3.0, unstable=True), r("b", "correct", 1.5)]
    assert fast_p(noisy, 0.0) == 1.0 and fast_p(noisy, 1.0) == 0.5 and geomean_speedup(noisy) == pytest.approx(1.5)
    assert noisy[0].credited_speedup is None and noisy[1].credited_speedup == 1.5


def _cli(store, kb_cache, candidates, name, *extra) -> int:
    return main(["eval", "kernelbench", "--problems", str(PROBLEMS), "--level", "1", "--candidates", str(candidates),
                 "--store", str(store), "--name", name, "--cache-dir", str(kb_cache), "--scale", "0.25",
                 "--trials", "2", "--iters", "3", *extra])


def test_candidates_through_the_cli_store_resume_export(relu_result, kb_cache, tmp_path, capsys):
    cands = tmp_path / "run"
    cands.mkdir()
    (cands / "level_1_problem_1_sample_0_kernel.py").write_text(RELU_OK)
    alias = RELU_OK.replace("        return relu_ext.relu_forward(x)", "        relu_ext.relu_forward(x)\n        return x")
    (cands / "level_1_problem_3_sample_0_kernel.py").write_text(alias)  # problem 2 has no candidate
    store_path, export, plot = tmp_path / "runs.duckdb", tmp_path / "eval_results.json", tmp_path / "speedups.png"
    assert _cli(store_path, kb_cache, cands, "kb1", "--export", str(export), "--plot", str(plot)) == 0
    data = json.loads(export.read_text())
    assert set(data) == {"1", "3"}
    e1 = data["1"][0]
    assert e1["sample_id"] == 0 and e1["compiled"] and e1["correctness"] and e1["runtime"] > 0 and e1["ref_runtime"] > 0
    assert e1["metadata"]["scale"] == 0.25 and e1["runtime_stats"]["num_trials"] in (3, 6)  # re-timed when noisy
    assert data["3"][0]["correctness"] is False and data["3"][0]["metadata"]["status"] == "incorrect"
    assert plot.exists() and plot.stat().st_size > 0

    store = RunStore(store_path)
    parent = store.list_runs(kind="eval", tag="eval:kb1")[0]
    assert parent.status == "completed"
    assert parent.outcome["summary"]["fast_p"]["fast_0"] == pytest.approx(1 / 3)  # over all three problems
    assert parent.outcome["summary"]["outcomes"] == {"agent_error": 1, "graded": 2}
    children = store.list_runs(limit=None, parent_id=parent.id)
    assert len(children) == 3
    del store

    capsys.readouterr()
    assert _cli(store_path, kb_cache, cands, "kb1") == 0  # resume: nothing runs again
    assert "ran 0, from store 3" in capsys.readouterr().out
    store = RunStore(store_path)
    assert len(store.list_runs(limit=None, parent_id=parent.id)) == 3
    del store
    assert _cli(store_path, kb_cache, cands, "kb1", "--policy", "lenient") == 2  # other settings: refused
    assert "other settings" in capsys.readouterr().err


def test_kernel_graph_with_a_scripted_model(relu_result, kb_cache, problems, tmp_path):
    pytest.importorskip("closedloop.graphs.kernel")
    reply = AssistantMessage(content=f"Here is the kernel.\n```python\n{RELU_OK}```")
    client = ScriptedClient([reply], cycle=True)
    settings = KernelBenchSettings(name="agent", agent="kernel", model="scripted:relu", rounds=1, scale=0.25,
                                   trials=2, iters=3, cache_dir=str(kb_cache), concurrency=1)
    store = RunStore(tmp_path / "runs.duckdb")
    runner = KernelBenchRunner(settings, [problems[1]], store, agent=graph_agent("kernel", client, rounds=1))
    report = asyncio.run(runner.run())
    assert report.outcomes == {"graded": 1} and report.results[0].correct
    child = store.list_runs(limit=None, parent_id=runner.parent_id)[0]
    run = store.get_run(child.id)
    assert run.messages and "ModelNew" in (child.outcome or {}).get("code", "")


def test_samples_of_a_problem_are_distinct_seeded_draws(relu_result, kb_cache, problems, tmp_path):
    """pass@k needs K different draws: sample i runs with seed sampling_seed + i and the given
    temperature (a greedy graph default would make every sample the same)."""
    pytest.importorskip("closedloop.graphs.kernel")
    from closedloop.graphs.kernel import KERNEL_PARAMS

    seen: list[tuple[int | None, float]] = []

    class Recording(ScriptedClient):
        async def generate(self, messages, tools=None, params=None, tool_choice=None):
            seen.append((params.seed, params.temperature))
            return await super().generate(messages, tools, params, tool_choice)

    reply = AssistantMessage(content=f"Here is the kernel.\n```python\n{RELU_OK}```")
    settings = KernelBenchSettings(name="draws", agent="kernel", model="scripted:relu", rounds=1, scale=0.25,
                                   trials=2, iters=3, cache_dir=str(kb_cache), concurrency=1, samples=3,
                                   temperature=0.8, sampling_seed=100)
    agent = graph_agent("kernel", Recording([reply], cycle=True), rounds=1,
                        params=KERNEL_PARAMS.model_copy(update={"temperature": 0.8}), sampling_seed=100)
    report = asyncio.run(KernelBenchRunner(settings, [problems[1]], RunStore(tmp_path / "r.duckdb"),
                                           agent=agent).run())
    assert report.outcomes == {"graded": 3}
    assert sorted({s for s, _ in seen}) == [100, 101, 102] and {t for _, t in seen} == {0.8}


def test_reference_as_candidate_through_the_cli(kb_cache, tmp_path, capsys):
    """``--candidate-source reference``: every problem's Model judged as its own ModelNew."""
    store_path = tmp_path / "runs.duckdb"
    code = main(["eval", "kernelbench", "--problems", str(PROBLEMS), "--level", "1", "--candidate-source", "reference",
                 "--store", str(store_path), "--name", "self", "--cache-dir", str(kb_cache), "--scale", "0.25",
                 "--trials", "2", "--iters", "5"])
    assert code == 0, capsys.readouterr().err
    store = RunStore(store_path)
    parent = store.list_runs(kind="eval", tag="eval:self")[0]
    assert parent.outcome["summary"]["statuses"] == {"correct": 3}
    assert parent.outcome["summary"]["fast_p"]["fast_0"] == 1.0
    assert parent.config["candidate_source"] == "reference"
    assert main(["eval", "kernelbench", "--problems", str(PROBLEMS), "--candidate-source", "reference",
                 "--candidates", str(tmp_path)]) == 2
    assert "takes neither" in capsys.readouterr().err
