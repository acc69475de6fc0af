"""Bad store paths: one clear line at open, never a traceback, never a surprise directory.

Issue 26: ``--store`` given a text file, a directory or ``/dev/null`` gave tracebacks, and a path
in a missing directory silently created the directories. The rule (``closedloop.store.location``):
a path that does not exist yet in an existing directory, or an existing DuckDB file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from closedloop.store import RunStore, StoreOpenError


def _bad_paths(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    empty = tmp_path / "empty.duckdb"
    empty.touch()
    return {
        "text file": (text, "holds something else, not a DuckDB database"),
        "empty file": (empty, "is an empty file"),
        "directory": (tmp_path, "is a directory"),
        "device": (Path("/dev/null"), "is not a regular file"),
        "missing directory": (tmp_path / "no" / "such" / "runs.duckdb", "directory .* does not exist"),
        "parent is a file": (text / "runs.duckdb", "a parent of it is a file"),
    }


@pytest.mark.parametrize("case", ["text file", "empty file", "directory", "device", "missing directory",
                                  "parent is a file"])
def test_a_bad_path_is_one_clear_line_and_touches_nothing(tmp_path, case):
    path, message = _bad_paths(tmp_path)[case]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(StoreOpenError, match=message) as info:
        RunStore(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    assert isinstance(info.value, ValueError)  # what a directory path raised before
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no directory, lock file or database left
    if case == "text file":
        assert path.read_text() == "not a database\n"


def test_directories_are_created_only_when_asked(tmp_path):
    path = tmp_path / "a" / "b" / "runs.duckdb"
    store = RunStore(path, create_dirs=True)
    assert store.list_runs() == [] and path.is_file()


def test_the_default_location_is_created(tmp_path, monkeypatch):
    monkeypatch.delenv("CLOSEDLOOP_STORE", raising=False)
    monkeypatch.setenv("CLOSEDLOOP_HOME", str(tmp_path / "home"))
    assert RunStore().path == tmp_path / "home" / "runs.duckdb" and (tmp_path / "home").is_dir()


@pytest.mark.parametrize("argv, case", [
    (["runs", "list"], "text file"), (["runs", "list"], "directory"), (["runs", "list"], "device"),
    (["runs", "show", "abc"], "missing directory"), (["runs", "export", "--parquet", "out"], "text file"),
    (["tool", "call", "add", "--args", '{"a": 1, "b": 2}'], "missing directory")])
def test_commands_print_one_line_for_a_bad_store(tmp_path, argv, case):
    path, _ = _bad_paths(tmp_path)[case]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "closedloop", *argv, "--store", str(path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: run store path") and str(path) in proc.stderr
    assert not (tmp_path / "no").exists() and not (tmp_path / "out").exists()


def test_check_store_path_is_the_rule_callers_can_run_before_opening(tmp_path):
    """``check_store_path`` is what a trainer's config check calls (a store to write, or with
    ``must_exist`` one to read a dataset from): the same rule and messages as opening, creating nothing."""
    from closedloop.store.location import check_store_path

    for path, message in _bad_paths(tmp_path).values():
        with pytest.raises(StoreOpenError, match=message):
            check_store_path(str(path))
    new = tmp_path / "new.duckdb"
    assert check_store_path(str(new)) == new and not new.exists()
    with pytest.raises(StoreOpenError, match="no such run store") as info:
        check_store_path(new, must_exist=True)
    assert str(new) in str(info.value) and isinstance(info.value, ValueError)
    RunStore(new).close()
    assert check_store_path(new, must_exist=True) == new
