"""Where a run store may live: the rule every caller (and ``--store`` of every command) goes by.

A store path is either a file that does not exist yet, in a directory that does, or an existing
DuckDB database file. Anything else is a :class:`~closedloop.store.errors.StoreOpenError` with
one line naming the problem, raised before the file is touched: a directory, a device or pipe
(``/dev/null``), a file holding something else (a text file, an empty file: DuckDB refuses both,
and a store must never overwrite a user's file), a parent that is a file. A missing directory is
created only when the caller asks (``RunStore(create_dirs=True)``) or for the default location
(``$CLOSEDLOOP_STORE`` or ``~/.closedloop/runs.duckdb``): a mistyped ``--store`` path must not
leave a tree of new directories behind.

:func:`check_store_path` is the one check: ``RunStore`` runs it on open, and a caller that
validates a path ahead of opening it (a trainer's config: a store to write to, or one to read a
dataset from with ``must_exist=True``) calls it too, rather than restating the rule.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from closedloop.store.errors import StoreOpenError

__all__ = ["check_store_path"]

_DUCKDB_MAGIC = b"DUCK"  # bytes 8..12 of every DuckDB database file
_MAGIC_AT = 8


def check_store_path(path: str | os.PathLike[str], *, create_dirs: bool = False, must_exist: bool = False) -> Path:
    """``path`` (``~`` expanded) if a store can be opened or created there (see the module
    docstring), else :class:`StoreOpenError` (a ``ValueError``). ``must_exist``: only an existing
    store will do (a store to read from); ``create_dirs``: create a missing directory. Nothing is
    created or written unless ``create_dirs`` is given."""
    path = Path(path).expanduser()
    try:
        st = path.stat()
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise StoreOpenError(f"run store path {path}: a parent of it is a file, not a directory") from None
    except OSError as e:  # a parent that is a file (ENOTDIR), no permission to look
        raise StoreOpenError(f"run store path {path}: {e.strerror or e}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise StoreOpenError(f"run store path {path} is a directory; give a file such as {path / 'runs.duckdb'}")
        if not stat.S_ISREG(st.st_mode):
            raise StoreOpenError(f"run store path {path} is not a regular file (a device, pipe or socket); "
                                 "give a file such as runs.duckdb")
        try:
            with open(path, "rb") as f:
                head = f.read(_MAGIC_AT + len(_DUCKDB_MAGIC))
        except OSError as e:
            raise StoreOpenError(f"run store path {path} cannot be read: {e.strerror or e}") from None
        if head[_MAGIC_AT:] != _DUCKDB_MAGIC:
            what = "is an empty file" if not head else "holds something else"
            raise StoreOpenError(f"run store path {path} {what}, not a DuckDB database; give an existing run "
                                 "store or a path that does not exist yet")
        return path
    if must_exist:
        raise StoreOpenError(f"run store path {path}: no such run store (the file does not exist)")
    parent = path.parent
    if parent.is_dir():
        return path
    if parent.exists():
        raise StoreOpenError(f"run store path {path}: {parent} is not a directory")
    if not create_dirs:
        raise StoreOpenError(f"run store path {path}: directory {parent} does not exist; create it first")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreOpenError(f"run store path {path}: cannot create directory {parent}: {e.strerror or e}") from None
    return path
