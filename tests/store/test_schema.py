"""Schema versioning: the version is recorded, new steps run once, newer files are refused."""

from __future__ import annotations

import duckdb
import pytest

from closedloop.config import default_store_path, get_settings
from closedloop.store import MIGRATIONS, SCHEMA_VERSION, RunStore, StoreVersionError
from closedloop.store import schema


def _versions(path) -> list[int]:
    with duckdb.connect(str(path)) as con:
        return [r[0] for r in con.execute("SELECT version FROM schema_version ORDER BY version").fetchall()]


def test_fresh_file_is_at_current_version(store_path):
    RunStore(store_path)
    RunStore(store_path)  # reopening applies nothing twice
    assert _versions(store_path) == list(range(1, SCHEMA_VERSION + 1))


def test_migration_hook_upgrades_an_old_file_once(store_path, monkeypatch):
    store = RunStore(store_path)
    rid = store.start_run(graph="before")
    calls = []

    def add_priority(con):
        calls.append(1)
        con.execute("ALTER TABLE runs ADD COLUMN priority INTEGER DEFAULT 0")

    monkeypatch.setattr(schema, "MIGRATIONS", [*MIGRATIONS, add_priority])
    RunStore(store_path)
    RunStore(store_path)
    assert calls == [1] and _versions(store_path)[-1] == SCHEMA_VERSION + 1
    with duckdb.connect(str(store_path)) as con:
        assert con.execute("SELECT graph, priority FROM runs WHERE id = ?", [rid]).fetchone() == ("before", 0)


def test_failed_migration_leaves_the_previous_version(store_path, monkeypatch):
    RunStore(store_path)

    def broken(con):
        con.execute("ALTER TABLE runs ADD COLUMN half INTEGER")
        raise RuntimeError("migration bug")

    monkeypatch.setattr(schema, "MIGRATIONS", [*MIGRATIONS, broken])
    with pytest.raises(RuntimeError, match="migration bug"):
        RunStore(store_path)
    assert _versions(store_path)[-1] == SCHEMA_VERSION
    with duckdb.connect(str(store_path)) as con:
        assert "half" not in [r[0] for r in con.execute("DESCRIBE runs").fetchall()]


def test_newer_file_is_refused(store_path):
    RunStore(store_path)
    with duckdb.connect(str(store_path)) as con:
        con.execute("INSERT INTO schema_version VALUES (?, now()::TIMESTAMP)", [SCHEMA_VERSION + 5])
    with pytest.raises(StoreVersionError, match="upgrade closedloop"):
        RunStore(store_path)


def test_default_path_follows_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("CLOSEDLOOP_STORE", raising=False)
    monkeypatch.setenv("CLOSEDLOOP_HOME", str(tmp_path / "home"))
    assert default_store_path() == tmp_path / "home" / "runs.duckdb"
    assert get_settings().artifacts_dir == tmp_path / "home" / "artifacts"
    monkeypatch.setenv("CLOSEDLOOP_STORE", str(tmp_path / "elsewhere.duckdb"))
    store = RunStore()
    assert store.path == tmp_path / "elsewhere.duckdb" and store.path.exists()


def test_directory_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        RunStore(tmp_path)
