"""Where closedloop keeps its files, read from the environment at the moment of use.

Settings are re-read on every :func:`get_settings` call instead of cached at import: tests and
long-lived processes change ``CLOSEDLOOP_*`` variables and expect the next call to see them.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel

__all__ = ["Settings", "get_settings", "default_store_path"]


def _home() -> Path:
    return Path(os.environ.get("CLOSEDLOOP_HOME") or Path.home() / ".closedloop").expanduser()


class Settings(BaseModel):
    """Paths shared by the run store, artifacts and the CLI.

    ``CLOSEDLOOP_HOME`` (default ``~/.closedloop``) roots the defaults; ``CLOSEDLOOP_STORE``,
    ``CLOSEDLOOP_ARTIFACTS`` and ``CLOSEDLOOP_PRICES`` (a JSON file ``{model: [usd_per_mtok_in,
    usd_per_mtok_out]}``) override single paths.
    """

    home: Path
    store_path: Path
    artifacts_dir: Path
    prices_path: Path | None = None

    @classmethod
    def from_env(cls) -> "Settings":
        home = _home()
        env = os.environ
        return cls(
            home=home,
            store_path=Path(env.get("CLOSEDLOOP_STORE") or home / "runs.duckdb").expanduser(),
            artifacts_dir=Path(env.get("CLOSEDLOOP_ARTIFACTS") or home / "artifacts").expanduser(),
            prices_path=Path(env["CLOSEDLOOP_PRICES"]).expanduser() if env.get("CLOSEDLOOP_PRICES") else None,
        )


def get_settings() -> Settings:
    return Settings.from_env()


def default_store_path() -> Path:
    """``$CLOSEDLOOP_STORE`` or ``~/.closedloop/runs.duckdb``."""
    return get_settings().store_path
