"""The generated retail domain: deterministic, the real schema, and every gold task replays to a
DB match through the real orchestrator, evaluator and CLI."""

from __future__ import annotations

import json

import pytest

from closedloop.evals.tau import evaluate, load_domain, run_episode
from closedloop.evals.tau.domains.retail.db import RetailDB
from closedloop.evals.tau.oracle import OracleAgent, ScenarioUser
from closedloop.evals.tau.synthetic import TASK_KINDS, GenerationError, generate_retail, main, write_retail
from closedloop.messages import AssistantMessage

from ._support import ANCHORS


def test_deterministic_given_the_seed():
    a, b, c = generate_retail(10, seed=3), generate_retail(10, seed=3), generate_retail(10, seed=4)
    assert json.dumps(a.__dict__, sort_keys=True) == json.dumps(b.__dict__, sort_keys=True)
    assert a.db != c.db and a.tasks != c.tasks


def test_db_has_the_retail_schema_and_unambiguous_users():
    dom = generate_retail(15, seed=0)
    RetailDB.model_validate(dom.db)
    users = dom.db["users"].values()
    assert len(users) == 15
    assert len({(u["name"]["first_name"], u["name"]["last_name"], u["address"]["zip"]) for u in users}) == 15
    assert len({u["email"] for u in users}) == 15
    for oid, order in dom.db["orders"].items():
        assert oid in dom.db["users"][order["user_id"]]["orders"]
        for item in order["items"]:
            variant = dom.db["products"][item["product_id"]]["variants"][item["item_id"]]
            assert item["options"] == variant["options"] and item["price"] == variant["price"]
    assert {t["description"]["purpose"].split(": ")[1] for t in dom.tasks} == set(TASK_KINDS)
    assert sorted(dom.split["train"] + dom.split["test"], key=int) == [t["id"] for t in dom.tasks]
    assert dom.split["test"] and not set(dom.split["train"]) & set(dom.split["test"])


def test_record_fields_match_the_real_retail_db():
    real_path = ANCHORS / "tau2" / "domains" / "retail" / "db.json"
    if not real_path.is_file():
        pytest.skip("τ anchors not present")
    real, ours = json.loads(real_path.read_text()), generate_retail(10, seed=1).db
    assert set(ours) == set(real)

    def shapes(db):
        product = next(iter(db["products"].values()))
        return {"product": set(product), "variant": set(next(iter(product["variants"].values()))),
                "user": set(next(iter(db["users"].values()))),
                "order": set.union(*(set(o) for o in db["orders"].values())),
                "item": set(next(iter(db["orders"].values()))["items"][0]),
                "methods": {frozenset(m) for u in db["users"].values() for m in u["payment_methods"].values()}}

    got, want = shapes(ours), shapes(real)
    assert {k: v for k, v in got.items() if k != "methods"} == {k: v for k, v in want.items() if k != "methods"}
    assert got["methods"] <= want["methods"]


async def test_the_oracle_matches_the_gold_db_on_every_task(tmp_path):
    root = write_retail(tmp_path, users=12, seed=5)
    data = load_domain("retail", root)
    tasks = data.load_tasks("base")
    assert len(tasks) == 12 and len(data.load_tasks("train")) + len(data.load_tasks("test")) == 12
    for task in tasks.tasks:
        sim = await run_episode(task, OracleAgent(task), ScenarioUser(task), environment_factory=data.make_environment)
        info = await evaluate(sim, task, data.make_environment)
        assert info.db_check.db_match and info.reward == 1.0, (task.id, info.reward_breakdown)


async def test_an_agent_that_does_nothing_fails(tmp_path):
    data = load_domain("retail", write_retail(tmp_path, users=6, seed=2))
    task = data.load_tasks("base").tasks[0]

    async def idle(messages, tools):
        return AssistantMessage(content="Done.")

    sim = await run_episode(task, idle, ScenarioUser(task), environment_factory=data.make_environment)
    info = await evaluate(sim, task, data.make_environment)
    assert not info.db_check.db_match and info.reward == 0.0


def test_command_line_then_eval_tau_oracle(tmp_path, capsys):
    out = tmp_path / "data"
    assert main([str(out), "--users", "8", "--seed", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main([str(out), "--users", "8"]) == 2 and "--force" in capsys.readouterr().err
    assert main([str(out), "--users", "9", "--force"]) == 0

    from closedloop.cli import main as cli

    export = tmp_path / "results.json"
    rc = cli(["eval", "tau", "--agent", "oracle", "--data-dir", str(out), "--split", "test",
              "--store", str(tmp_path / "runs.duckdb"), "--export", str(export)])
    assert rc == 0
    sims = json.loads(export.read_text())["simulations"]
    split = json.loads((out / "tau2/domains/retail/split_tasks.json").read_text())
    assert sorted(s["task_id"] for s in sims) == sorted(split["test"])
    assert all(s["reward_info"]["db_check"]["db_match"] is True and s["reward_info"]["reward"] == 1.0 for s in sims)


def test_bad_parameters_are_clear_errors():
    with pytest.raises(GenerationError, match="users"):
        generate_retail(0)
    with pytest.raises(GenerationError, match="products"):
        generate_retail(5, products=99)
    with pytest.raises(GenerationError, match="tasks"):
        generate_retail(2, tasks=50)
