"""Subcommands that are listed without being imported.

``closedloop`` and ``closedloop eval`` take their subcommands from plugins whose entry points name a
``register(subparsers)`` hook. Building every hook's parser up front imported every subcommand's
machinery (about 1,200 modules for ``closedloop --help``); here a subcommand is listed by name and
its module's one-line docstring, and its hook runs only when argparse meets that name.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

from closedloop.plugins import Registry


class LazySubcommands(argparse._SubParsersAction):
    """A subparsers action whose subcommands' parsers are built when chosen.

    Used as ``parser.add_subparsers(action=LazySubcommands, ...)``; eager ``add_parser`` calls work
    as usual. ``argparse`` checks a subcommand's name against the listed ones before calling the
    action, so unknown names and ``--help`` behave as with eager parsers.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._builders: dict[str, Callable[[argparse._SubParsersAction], None]] = {}

    def add_lazy(self, name: str, help: str, build: Callable[[argparse._SubParsersAction], None]) -> None:
        """List ``name`` now; ``build(self)`` must add its parser (``self.add_parser(name, ...)``) when chosen."""
        self.add_parser(name, help=help, add_help=False)  # a placeholder: only its name and help are used
        self._builders[name] = build

    def add_plugins(self, plugins: Registry) -> None:
        """One lazy subcommand per plugin; the plugin is a ``register(subparsers)`` hook."""
        for name in plugins.names():
            self.add_lazy(name, _help(plugins.describe(name)), _hook(plugins, name))

    def build_all(self) -> None:
        """Build every listed subcommand's parser now (for a walk over the whole command tree, as
        the help checks in the tests do); a plugin that fails to build raises."""
        for name in list(self._builders):
            del self._name_parser_map[name]
            self._choices_actions = [a for a in self._choices_actions if a.dest != name]
            self._builders.pop(name)(self)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        assert isinstance(values, list) and values
        name = values[0]
        build = self._builders.pop(name, None)
        if build is not None:
            del self._name_parser_map[name]
            self._choices_actions = [a for a in self._choices_actions if a.dest != name]
            try:
                build(self)
            except Exception as e:  # noqa: BLE001 - a broken plugin is reported, not a traceback
                parser.error(f"{name!r} could not be loaded: {type(e).__name__}: {e}")
            if name not in self._name_parser_map:
                parser.error(f"the plugin for {name!r} did not add a subcommand named {name!r}")
        super().__call__(parser, namespace, values, option_string)


def lazy_subparsers(parser: argparse.ArgumentParser, **kwargs: Any) -> LazySubcommands:
    """``parser.add_subparsers(**kwargs)`` with lazily built subcommands."""
    sub = parser.add_subparsers(action=LazySubcommands, **kwargs)
    assert isinstance(sub, LazySubcommands)
    return sub


def _hook(plugins: Registry, name: str) -> Callable[[argparse._SubParsersAction], None]:
    def build(sub: argparse._SubParsersAction) -> None:
        plugins.load(name)(sub)

    return build


def _help(summary: str) -> str:
    """A module summary as subcommand help: "closedloop runs: list ... store." -> "list ... store."."""
    if summary.startswith("closedloop ") and ": " in summary:
        summary = summary.split(": ", 1)[1]
    return summary.replace("%", "%%")  # argparse %-formats help
