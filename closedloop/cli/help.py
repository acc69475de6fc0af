"""How every ``closedloop`` command's ``--help`` reads: defaults shown, plain text.

One parser class for the whole command tree (subcommand parsers inherit it through
``add_subparsers``), so a command written as a plugin gets the same help as the built-in ones
without asking: each option's default is appended to its help (unless the help already says what
the default is, or there is none worth showing: ``None``, ``False``, an empty list), descriptions
keep their line breaks, and reST markup from docstrings (````x````, ``:mod:`x```) is shown as plain text.
"""

from __future__ import annotations

import argparse
from typing import Any

from closedloop.plugins import plain_text

__all__ = ["ClosedloopParser", "HelpFormatter"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter with defaults in the help (as ``ArgumentDefaultsHelpFormatter``, but
    only where a default is worth showing) and reST markup unwrapped."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "default" in text.lower() or default is argparse.SUPPRESS
                or default is None or default is False or (isinstance(default, (str, list, tuple)) and not default)
                or isinstance(action, argparse._VersionAction)):
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action))


class ClosedloopParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that formats help with :class:`HelpFormatter` (whatever formatter a
    subcommand asks for: the plain argparse ones would drop the defaults)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        formatter = kwargs.get("formatter_class")
        if formatter is None or not issubclass(formatter, HelpFormatter):
            kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)
