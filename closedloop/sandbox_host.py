"""The host side of :mod:`closedloop.sandbox`: whether namespaces work here, pids cgroups, the
on-disk entries a sandbox owns (and reaping those whose owner died), a sandbox's process tree as
``/proc`` shows it, and JSON from untrusted code read without recursion."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["owned_tempdir", "reap_stale", "process_tree", "task_count", "bounded_json_loads", "MAX_RESULT_DEPTH"]

#: Deepest nesting accepted in a sandbox's JSON result (a deeper one is an error, never a crash).
MAX_RESULT_DEPTH = 64


@functools.lru_cache(maxsize=1)
def _unshare_works() -> bool:
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return False
    try:
        probe = subprocess.run([exe, "-rn", "--pid", "--fork", "--kill-child", "true"],
                               capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@functools.lru_cache(maxsize=1)
def _pids_cgroup_root() -> Path | None:
    """A writable cgroup (v1 ``pids`` hierarchy, or v2 with the pids controller) to cap the
    sandbox's process count when RLIMIT_NPROC cannot (real root is exempt from it)."""
    candidates = [Path("/sys/fs/cgroup/pids")]
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                v2 = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
                if "pids" in (v2 / "cgroup.subtree_control").read_text():
                    candidates.append(v2)
    except OSError:
        pass
    for root in candidates:
        probe = root / f"closedloop-probe-{os.getpid()}"
        try:
            probe.mkdir()
            ok = (probe / "pids.max").exists()
            probe.rmdir()
        except OSError:
            continue
        if ok:
            return root
    return None


def _make_cgroup(processes: int) -> Path | None:
    root = _pids_cgroup_root()
    if root is None:
        return None
    reap_stale()
    path = root / f"closedloop-sandbox-{_owner_tag()}-{os.urandom(6).hex()}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(processes))
    except OSError:
        try:
            path.rmdir()
        except OSError:
            pass
        return None
    return path


def _remove_cgroup(path: Path | None) -> None:
    if path is None:
        return
    for _ in range(50):
        try:
            path.rmdir()
            return
        except OSError:
            try:
                for pid in (path / "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
            time.sleep(0.02)


# ------------------------------------------------------------------ ownership and reaping
# A caller killed by SIGKILL or SIGTERM runs no cleanup. Everything it creates on disk (temporary
# directories, pids cgroups) is named ``closedloop-<kind>-<pid>.<pidns>-<random>``; whoever starts
# next removes the entries whose owner is no longer alive (same PID namespace, same user).
_OWNED = re.compile(r"^closedloop-([a-z]+)-(\d+)\.(\d+)-")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _owner_tag() -> str:
    return f"{os.getpid()}.{_pid_namespace()}"


def owned_tempdir(kind: str) -> Path:
    """A fresh private temporary directory (mode 0700) named after this process, so that it is
    removed by :func:`reap_stale` in a later process if this one dies without removing it."""
    if not re.fullmatch(r"[a-z]+", kind):
        raise ValueError(f"kind must be lowercase letters, got {kind!r}")
    reap_stale()
    return Path(tempfile.mkdtemp(prefix=f"closedloop-{kind}-{_owner_tag()}-"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_REAPED: set[int] = set()


def reap_stale(force: bool = False) -> list[str]:
    """Remove the temporary directories and cgroups of sandbox owners that died without cleaning
    up (run once per process on first use; ``force`` runs it again). Returns what was removed."""
    if os.getpid() in _REAPED and not force:
        return []
    _REAPED.add(os.getpid())
    ns, uid, removed = _pid_namespace(), os.getuid(), []
    roots = [Path(tempfile.gettempdir())]
    cgroup_root = _pids_cgroup_root()
    if cgroup_root is not None:
        roots.append(cgroup_root)
    for root in roots:
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            m = _OWNED.match(entry.name)
            if m is None or int(m.group(3)) != ns or _alive(int(m.group(2))):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid or not entry.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            if root == cgroup_root:
                _remove_cgroup(Path(entry.path))
            else:
                shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


# ------------------------------------------------------------------ the caller's view of a sandbox
def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (host PIDs, read from ``/proc``; nothing the sandboxed
    code says). Empty when ``pid`` is gone."""
    out: list[int] = []
    todo = [pid]
    seen: set[int] = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        out.append(p)
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    todo += [int(x) for x in fh.read().split()]
            except (OSError, ValueError):
                pass
    return out


def task_count(pid: int) -> int:
    """Threads of process ``pid`` (0 when it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def bounded_json_loads(text: str | bytes, *, max_depth: int = MAX_RESULT_DEPTH) -> Any:
    """``json.loads`` that raises ``ValueError`` (never ``RecursionError``) on input nested
    deeper than ``max_depth``: for JSON written by code that is not trusted."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than the interpreter's recursion limit (max {max_depth})") from None
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (list, dict)):
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return value
