"""The RFT generalisation protocol: matrix formulas, mixture sampling ratios, configs, and a short
sequential run of the tiny model end to end (GRPO stages, evaluation rows, store, table, heatmap)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from closedloop.evals.envs import make_env
from closedloop.trainers.config import ConfigError, load_config
from closedloop.trainers.rft import EnvSpec, EvalMatrix, MixtureEnv, RFTConfig, mixture_choice, render_table


def _matrix() -> EvalMatrix:
    # base, after stage 1 (trained A), after stage 2 (trained B); C never trained (held out)
    return EvalMatrix(rows=["base", "1:A", "2:B"], cols=["A", "B", "C"],
                      scores=[[0.10, 0.20, 0.30],
                              [0.70, 0.25, 0.35],
                              [0.50, 0.80, 0.40]],
                      trained_at={"A": 1, "B": 2})


def test_matrix_formulas_on_a_hand_made_matrix():
    m = _matrix()
    gain = m.gain()
    assert gain[0] == [0.0, 0.0, 0.0]
    assert gain[1] == pytest.approx([0.60, 0.05, 0.05])
    assert gain[2] == pytest.approx([0.40, 0.60, 0.10])
    assert m.transfer() == pytest.approx({"C": 0.10})           # held out: final − base
    assert m.forgetting() == pytest.approx({"A": 0.20, "B": 0.0})  # score after its stage − final
    d = m.as_dict()
    assert d["transfer"] == pytest.approx({"C": 0.10}) and d["rows"][0] == "base"


def test_matrix_refuses_bad_shapes_and_labels():
    with pytest.raises(ValueError, match="3 x 3"):
        EvalMatrix(["base", "1", "2"], ["A", "B", "C"], [[0, 0, 0], [0, 0]])
    with pytest.raises(ValueError, match="unknown"):
        EvalMatrix(["base"], ["A"], [[0.0]], trained_at={"Z": 0})
    with pytest.raises(ValueError, match="base"):
        EvalMatrix(["1"], ["A"], [[0.0]], base_row=None).transfer()


def test_render_table_marks_held_out_columns():
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(render_table(_matrix()))
    text = console.export_text()
    assert "C *" in text and "A *" not in text
    assert "+0.200" in text and "transfer" in text and "+0.600" in text


def test_mixture_sampling_respects_its_ratios():
    from scipy.stats import chisquare

    weights = [1.0, 2.0, 5.0]
    n = 8000
    counts = Counter(mixture_choice(seed, weights) for seed in range(n))
    observed = [counts[i] for i in range(3)]
    expected = [n * w / sum(weights) for w in weights]
    assert chisquare(observed, expected).pvalue > 1e-3
    # the test has power: the same draws are far from uniform, and from a swapped ratio
    assert chisquare(observed, [n / 3] * 3).pvalue < 1e-9
    assert chisquare(observed, [n * w / 8 for w in (5.0, 2.0, 1.0)]).pvalue < 1e-9
    # a group (same seed) always gets the same environment
    assert all(mixture_choice(s, weights) == mixture_choice(s, weights) for s in range(100))
    with pytest.raises(ValueError, match="positive"):
        mixture_choice(0, [1.0, 0.0])


def test_mixture_env_delegates_per_seed():
    specs = [EnvSpec(name="calc", options={"level": 1}), EnvSpec(name="simul", options={"level": 1})]
    env = MixtureEnv([s.factory() for s in specs], [1, 1], [s.key for s in specs])

    async def play(seed):
        obs, info = await env.areset(seed)
        return info["mixture_env"], info["env"], obs[-1].content

    seen = {asyncio.run(play(s))[:2] for s in range(40)}
    assert seen == {("calc-L1", "calc"), ("simul-L1", "simul")}
    assert asyncio.run(play(7)) == asyncio.run(play(7))
    assert asyncio.run(play(7))[2] == asyncio.run(make_env(
        "calc" if mixture_choice(7, [1, 1]) == 0 else "simul", level=1).areset(7))[0][-1].content


def test_config_validation(tmp_path):
    cfg = RFTConfig(model="m", output_dir=str(tmp_path), env="clarify", env_options={"level": 2})
    assert [e.key for e in cfg.envs] == ["clarify-L2"] and cfg.mode == "single"
    with pytest.raises(ValueError, match="single trains on one"):
        RFTConfig(model="m", output_dir="o", envs=[{"name": "calc"}, {"name": "simul"}])
    with pytest.raises(ValueError, match="no environment named 'chess'"):
        RFTConfig(model="m", output_dir="o", envs=[{"name": "chess"}])
    with pytest.raises(ValueError, match="level"):
        RFTConfig(model="m", output_dir="o", envs=[{"name": "calc", "options": {"level": 99}}])
    with pytest.raises(ValueError, match="distinct"):
        RFTConfig(model="m", output_dir="o", mode="sequential", envs=[{"name": "calc"}, {"name": "calc"}])
    with pytest.raises(ConfigError, match="weight"):
        load_config(RFTConfig, None, ["model=m", "output_dir=o", "mode=mixture",
                                      "envs=[{name: calc, weight: 0}, {name: simul}]"])
    cfg = RFTConfig(model="m", output_dir="o", mode="sequential", envs=[{"name": "calc"}, {"name": "simul"}],
                    eval_envs=[{"name": "clarify"}])
    assert [c.key for c in cfg.columns] == ["clarify", "calc", "simul"]  # trained envs are always columns


def test_sequential_run_end_to_end(tmp_path, tiny_model_path):
    from closedloop.store import RunStore
    from closedloop.trainers.rft import run_rft

    store = tmp_path / "runs.duckdb"
    cfg = load_config(RFTConfig, None, [
        f"model={tiny_model_path}", f"output_dir={tmp_path / 'rft'}", f"store={store}", "mode=sequential",
        "envs=[{name: calc, options: {level: 1}}, {name: simul, options: {level: 1}, max_env_steps: 6}]",
        "eval_envs=[{name: clarify, options: {level: 1}}]",
        "steps_per_stage=1", "prompts_per_step=2", "num_generations=2", "max_env_steps=3", "max_new_tokens=12",
        "eval_episodes=2", "learning_rate=1e-3", "torch_threads=1", "save_steps=null"])
    result = run_rft(cfg, log=lambda s: None)
    m = result.matrix
    assert m.rows == ["base", "1:calc-L1", "2:simul-L1"]
    assert m.cols == ["clarify-L1", "calc-L1", "simul-L1"]
    assert m.trained_at == {"calc-L1": 1, "simul-L1": 2}
    assert set(m.transfer()) == {"clarify-L1"} and set(m.forgetting()) == {"calc-L1", "simul-L1"}
    assert [s.steps for s in result.stages] == [1, 1]
    # stage 2 started from stage 1's model
    ckpt = next((result.stages[1].output_dir).glob("checkpoint-*"))
    assert json.loads((ckpt / "train_config.json").read_text())["model"] == str(result.stages[0].output_dir)
    saved = json.loads((tmp_path / "rft" / "matrix.json").read_text())
    assert saved["scores"] == m.scores and (tmp_path / "rft" / "matrix.png").stat().st_size > 0
    s = RunStore(store)
    try:
        run = s.get_run(result.run_id)
        assert run.status == "completed" and run.outcome["matrix"]["cols"] == m.cols
        rows = {r["step"]: r for r in s.metrics(result.run_id)}
        assert rows[0]["score/calc-L1"] == pytest.approx(m.scores[0][1])
        assert rows[2]["transfer/clarify-L1"] == pytest.approx(m.transfer()["clarify-L1"])
        assert rows[2]["forgetting/calc-L1"] == pytest.approx(m.forgetting()["calc-L1"])
    finally:
        s.close()
