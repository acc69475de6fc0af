"""The one plugin registry (closedloop.plugins) and ``closedloop plugins``: every kind from entry
points, found without importing, a user's package added the same way, duplicates refused."""

from __future__ import annotations

import json
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

from closedloop import plugins
from closedloop.evals.tau.domains import Domain, get_domain, register_domain

REPO = Path(__file__).resolve().parents[2]
DECLARED = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]


def test_every_declared_group_is_a_kind_and_the_installed_metadata_matches_pyproject():
    assert set(DECLARED) <= {k.group for k in plugins.KINDS.values()}
    for kind in plugins.KINDS.values():
        ours = {name: p.target for name, p in plugins.available(kind.group).items()
                if (p.distribution or "").startswith("closedloop ")}
        assert ours == DECLARED.get(kind.group, {}), (
            f"{kind.group}: the installed entry points differ from pyproject.toml; reinstall "
            f"(python -m pip install -e . --no-deps) and remove a stale closedloop.egg-info")


def test_plugins_command_lists_every_kind_with_its_source(site):
    out = site.run("plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    listed = {(r["kind"], r["name"]): r for r in rows}
    for kind in plugins.KINDS.values():
        for name, target in DECLARED.get(kind.group, {}).items():
            row = listed[(kind.name, name)]
            assert row["target"] == target and row["distribution"].startswith("closedloop ")
    assert listed[("trainers", "sft")]["description"].startswith("Supervised fine-tuning")
    table = site.run("plugins", "recipes")
    assert table.returncode == 0 and "recipes" in table.stdout


def test_discovery_and_descriptions_import_no_plugin(site):
    code = """
import json, sys
from closedloop import plugins
targets = []
for kind in plugins.KINDS:
    registry = plugins.registry(kind)
    for name, plugin in registry.plugins().items():
        registry.describe(name)
        targets.append(plugin.module)
print(json.dumps({"targets": targets, "imported": [t for t in targets if t in sys.modules]
                  + [m for m in ("torch", "langgraph", "duckdb", "pydantic") if m in sys.modules]}))
"""
    out = site.run(code=code)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["targets"]) >= 40 and result["imported"] == []


USER_PACKAGE = {
    "userpkg/__init__.py": '"""A user\'s package of closedloop plugins."""\n',
    "userpkg/shout.py": '''
        """Shouting tools (a user's tool module)."""
        from closedloop.tool import tool

        @tool
        def shout(text: str) -> str:
            """Upper-case a text.

            Args:
                text: What to shout.
            """
            return text.upper()

        TOOLS = [shout]
        ''',
    "userpkg/hello.py": '''
        """``closedloop hello``: greet someone (a user's command)."""

        def register(sub):
            p = sub.add_parser("hello")
            p.add_argument("--name", default="world")
            p.set_defaults(func=lambda args: print(f"hello {args.name}") or 0)
        ''',
    "userpkg/broken.py": '''
        """``closedloop eval broken``: a benchmark whose dependency is missing."""
        import userpkg_missing_dependency  # noqa: F401
        ''',
    "userpkg/echo.py": '''
        """An echo backend: replies with the model name."""
        from closedloop.messages import AssistantMessage
        from closedloop.models.scripted import ScriptedClient

        def make(spec, **options):
            return ScriptedClient([AssistantMessage(content=spec.model)], cycle=True, name=spec.model)
        ''',
    "userpkg/bank.py": '''
        """A one-table τ domain, given by a factory."""
        from closedloop.evals.tau.domains.base import TauDB, Toolkit
        from closedloop.evals.tau.domains.registry import Domain

        class BankDB(TauDB):
            balance: int = 0

        class BankTools(Toolkit):
            db: BankDB

        def bank():
            return Domain(name="bank", db_model=BankDB, toolkit=BankTools)
        ''',
}
USER_ENTRY_POINTS = {
    "closedloop.tools": {"shout": "userpkg.shout:TOOLS"},
    "closedloop.commands": {"hello": "userpkg.hello:register"},
    "closedloop.benchmarks": {"broken": "userpkg.broken:register"},
    "closedloop.backends": {"echo": "userpkg.echo:make"},
    "closedloop.domains": {"bank": "userpkg.bank:bank"},
}


def test_a_users_package_adds_plugins_of_every_kind_the_same_way(site):
    site.install("userpkg", USER_ENTRY_POINTS, USER_PACKAGE)
    listed = [json.loads(line) for line in site.run("plugins", "--json").stdout.splitlines()]
    mine = {(r["kind"], r["name"]): r for r in listed if r["distribution"] == "userpkg 1.0"}
    assert set(mine) == {("tools", "shout"), ("commands", "hello"), ("benchmarks", "broken"), ("backends", "echo"),
                         ("domains", "bank")}
    assert mine[("tools", "shout")]["description"] == "Shouting tools (a user's tool module)."

    hello = site.run("hello", "--name", "ada")
    assert hello.returncode == 0 and hello.stdout == "hello ada\n"
    assert "greet someone (a user's command)." in site.run("--help").stdout
    tools = site.run("tools", "shout", "arithmetic")
    assert tools.returncode == 0 and "Upper-case a text." in tools.stdout and "Add two numbers." in tools.stdout

    # a broken plugin is listed, and fails only when chosen, in one line
    assert "broken" in site.run("eval", "--help").stdout
    broken = site.run("eval", "broken")
    assert broken.returncode == 2 and "'broken' could not be loaded: ModuleNotFoundError" in broken.stderr
    assert "Traceback" not in broken.stderr

    code = """
import asyncio
from closedloop.models import make_client
from closedloop.evals.tau.domains import get_domain
client = make_client("echo:pong")
turn = asyncio.run(client.generate([]))
assert get_domain("bank") is get_domain("bank")  # a factory's domain is made once
print(turn.message.content, get_domain("bank").db_model.__name__)
"""
    out = site.run(code=code)
    assert out.returncode == 0 and out.stdout.split() == ["pong", "BankDB"], out.stderr


def test_a_name_two_distributions_declare_is_refused_with_both_sources(site):
    ours = f"closedloop {version('closedloop')}"

    def refused(argv: list[str], what: str, theirs: str) -> None:
        out = site.run(*argv)
        assert out.returncode != 0 and "Traceback" not in out.stderr, (argv, out.stderr)
        assert f"two distributions declare {what}" in out.stderr, (argv, out.stderr)
        assert ours in out.stderr and theirs in out.stderr, (argv, out.stderr)

    site.install("dupegraph", {"closedloop.graphs": {"react": "dupegraph:graph"}})
    refused(["graphs"], "the graph 'react'", "dupegraph 1.0 (dupegraph:graph)")
    refused(["plugins", "graphs"], "the graph 'react'", "dupegraph 1.0 (dupegraph:graph)")
    assert site.run("plugins", "tools").returncode == 0  # other kinds are unaffected
    out = site.run(code="from closedloop import plugins; plugins.load('closedloop.graphs', 'react')")
    assert "DuplicatePluginError: two distributions declare the graph 'react'" in out.stderr

    site.install("dupecommand", {"closedloop.commands": {"runs": "dupecommand:register"}})
    refused(["--help"], "the command 'runs'", "dupecommand 1.0 (dupecommand:register)")


class _Probe:
    """A stand-in plugin object for in-process registration."""


def test_in_process_registration_follows_the_same_rules():
    envs = plugins.registry("environments")
    probe = _Probe()
    with pytest.raises(plugins.DuplicatePluginError, match="environment named 'calc' is already registered"):
        envs.register("calc", probe)
    name = "probe_env_for_test"
    assert envs.register(name, probe) is probe and envs.load(name) is probe
    assert envs.register(name, probe) is probe  # the same object again: a no-op
    with pytest.raises(plugins.DuplicatePluginError):
        envs.register(name, _Probe())
    replacement = _Probe()
    envs.register(name, replacement, replace=True)
    assert envs.load(name) is replacement and envs.get(name).source == "registered in-process"
    with pytest.raises(plugins.PluginNotFound, match=r"no environment named 'nope'; available: \[.*'calc'"):
        envs.load("nope")


def test_register_domain_is_the_registry_and_refuses_a_builtin_name():
    retail = get_domain("retail")
    assert register_domain(retail) is retail  # the object the entry point gives: a no-op
    with pytest.raises(ValueError, match="τ domain named 'retail' is already registered"):
        register_domain(Domain(name="retail", db_model=retail.db_model, toolkit=retail.toolkit))


def test_loading_imports_only_the_plugin(site):
    code = """
import sys
from closedloop import plugins
plugins.load("closedloop.tools", "arithmetic")
plugins.load("closedloop.domains", "retail")
assert "closedloop.tools.arithmetic" in sys.modules and "closedloop.evals.tau.domains.retail" in sys.modules
print([m for m in ("closedloop.tools.phalar", "closedloop.evals.tau.domains.telecom", "torch") if m in sys.modules])
"""
    out = site.run(code=code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_registry_kinds_by_name_or_group():
    assert plugins.registry("graphs") is plugins.registry("closedloop.graphs")
    with pytest.raises(plugins.PluginNotFound, match="no plugin kind 'widgets'"):
        plugins.registry("widgets")


def test_stale_metadata_is_named_not_a_silent_empty_cli(site):
    site.install("closedloop", {})  # an install made before the entry points were declared, first on the path
    out = site.run("--help")
    assert out.returncode == 2 and "metadata is stale: reinstall it" in out.stderr and "Traceback" not in out.stderr
    out = site.run(code="from closedloop.models import parse_spec; parse_spec('hf:x')")
    assert "model spec 'hf:x': no closedloop.backends entry point is installed" in out.stderr
