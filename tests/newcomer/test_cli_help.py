"""Every ``closedloop`` command's ``--help`` is complete and readable (issue 30, "Discoverability").

The walk builds every subcommand's parser (lazy plugins included) and checks what a newcomer reads:
each option says what it does, defaults are shown, docstring markup never leaks, ``--version``
works, ``train --help`` lists the trainers, and ``plugins recipes`` describes each recipe by its own
description rather than its module's docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from closedloop import plugins
from closedloop.cli import build_parser, main
from closedloop.cli.lazy import LazySubcommands

# Parsers owned by work in progress elsewhere, with the options that still lack help there.
KNOWN_GAPS = {"closedloop eval kernelbench": {"--problem-ids", "--backend", "--policy"}}


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("closedloop",)):
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            if isinstance(action, LazySubcommands):
                action.build_all()
            for name, sub in action.choices.items():
                yield from walk(sub, path + (name,))


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    return dict(walk(build_parser()))


def test_every_option_of_every_command_has_help(parsers):
    assert {"closedloop run", "closedloop eval tau", "closedloop runs list", "closedloop model tiny"} <= set(parsers)
    missing = []
    for path, parser in parsers.items():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            name = action.option_strings[0] if action.option_strings else action.dest
            if not (action.help and action.help.strip()) and name not in KNOWN_GAPS.get(path, ()):
                missing.append(f"{path} {name}")
    assert missing == []


def test_help_shows_defaults_and_no_docstring_markup(parsers):
    texts = {path: parser.format_help() for path, parser in parsers.items()}
    for path, text in texts.items():
        assert "``" not in text and ":mod:" not in text and ":class:" not in text, path
    assert "TCP port to listen on (default: 8000)" in " ".join(texts["closedloop serve"].split())
    assert "(default: 20)" in texts["closedloop runs list"]
    tau = " ".join(texts["closedloop eval tau"].split())
    # --concurrency has no argparse default (on Ray the cluster sizes it), so its help names it itself
    assert "(default: retail)" in tau and "(default: 200)" in tau and "(default: 4;" in tau
    assert "(default: None)" not in tau
    run = " ".join(texts["closedloop run"].split())
    assert "(default: 0.0)" in run and "(default: None)" not in run and "(default: False)" not in run


def _out(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = int(e.code or 0)
    return code, buf.getvalue()


def test_version_and_train_help_list_what_exists():
    from importlib.metadata import version

    code, text = _out("--version")
    assert code == 0 and version("closedloop") in text
    code, text = _out("train", "--help")
    assert code == 0
    assert all(name in text for name in plugins.registry("trainers").names())


def test_plugins_recipes_describes_each_recipe_by_its_own_description(monkeypatch):
    from closedloop.trainers.recipes import load_recipe

    monkeypatch.setenv("COLUMNS", "400")
    code, text = _out("plugins", "recipes")
    assert code == 0
    names = plugins.registry("recipes").names()
    assert {"demo", "latency"} <= set(names)
    for name in names:
        own = load_recipe(name).description
        assert own and plugins.registry("recipes").describe(name) == own
        assert own in text
    assert "Recipes: a multi-stage pipeline" not in text  # the package docstring, shared by both


def test_listing_tools_names_the_module_that_tools_flags_take(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    code, text = _out("tools", "arithmetic")
    assert code == 0
    row = next(line for line in text.splitlines() if " add " in line)
    assert "arithmetic" in row
