"""Run untrusted code in a fresh, limited process and get a structured, JSON-only result back.

Why a process and not a thread: a thread cannot be stopped, so a tool that times out keeps
running (and writing) in the background; a process group can be killed. Why JSON only: the
child may run hostile code, and unpickling its output would hand it the parent.

What the child gets (each item reported in ``SandboxResult.enforced`` when the OS allowed it):

- a fresh interpreter (``subprocess`` spawn), ``python -I``, in its own session and
  process group, with a fresh temporary working directory that is removed afterwards;
- rlimits: address space, CPU time, open files, file size, and processes (RLIMIT_NPROC inside its
  own user namespace, where the count is the sandbox's own; a ``pids`` cgroup where one is
  writable, which also holds for root, whom RLIMIT_NPROC exempts);
- a wall-clock timeout that kills the whole process group (and the PID namespace when there is
  one, so a child that calls ``setsid`` dies too), enforced twice: by the caller, and inside the
  sandbox by a supervisor process that runs no target code (``wall_s`` plus a grace), so the
  work stops on time even when the caller is gone or stuck;
- no life after the caller: the supervisor kills the work when the caller exits (a lifeline
  pipe whose write end only the caller holds; the fork server's children die with the server,
  which exits when its caller's control socket closes); temporary directories and cgroups are
  named after their owner's PID, and those of owners that died without cleaning up (SIGKILL,
  SIGTERM) are removed at the next start;
- a scrubbed environment: PATH, HOME and TMPDIR pointing at the working directory, one thread
  per math library, and only the variables named in ``SandboxLimits.env``;
- no network (a new network namespace through ``unshare -rn``) where user namespaces work;
- writes confined to its directories with Landlock where the kernel has it;
- stdout/stderr truncated to ``output_bytes``.

Targets are named ``"package.module:function"`` and resolved in the child with the caller's
``sys.path``; a :class:`closedloop.tool.Tool` target calls its ``.fn``.

Sessions (:func:`open_sandboxed`): the same sandbox, kept running while the caller talks to the
target over a private socket (the target gets ``channel_fd=``): a judge can drive untrusted code
call by call without sharing a process with it. :func:`process_tree` and :func:`task_count` let
the caller inspect it from outside (``/proc``, which the sandboxed code cannot forge).

Fork-server mode (``preload=[modules]``, used by the KernelBench worker; the default stays the
fresh interpreter): a zygote started like the child above (``python -I``, scrubbed environment,
own session, outside any sandbox limits) imports the named trusted modules once and then only
forks. Each call gets a single-use child that, before anything of the target runs, closes every
inherited descriptor (so it cannot reach the zygote's control socket), calls ``setsid``, joins
the pids cgroup, enters new user + network + PID namespaces (``unshare(2)``, a waiter as PID 1),
takes the scrubbed environment and working directory, then sets the same rlimits and Landlock
rules as the spawn path. The parent keeps the wall clock and kills the child's group. What it
does not give: a pristine interpreter state beyond what the preloaded modules set up at import
(the zygote never runs target code, so nothing of one call reaches another).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from closedloop.sandbox_host import (MAX_RESULT_DEPTH, _make_cgroup, _remove_cgroup, _unshare_works,
                                     bounded_json_loads, owned_tempdir, process_tree, reap_stale, task_count)
from closedloop.sandbox_limits import SandboxLimits, SandboxResult, Status

__all__ = ["SandboxLimits", "SandboxResult", "SandboxSession", "run_sandboxed", "arun_sandboxed", "open_sandboxed",
           "isolation_available", "shutdown_fork_servers", "owned_tempdir", "reap_stale", "process_tree",
           "task_count", "bounded_json_loads", "MAX_RESULT_DEPTH"]

_CHILD = str(Path(__file__).with_name("_sandbox_child.py"))
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE, signal.SIGTRAP}
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS")
#: How much longer than ``wall_s`` the in-sandbox supervisor waits: the caller's own clock, which
#: reports "timeout", normally fires first; the supervisor's is for a caller that is gone or stuck.
SUPERVISOR_GRACE_S = 5.0
_CHANNEL_FD = 3  # where a fork-server child keeps a session's channel (see _sandbox_child.CHANNEL_FD)


def _scrubbed_env(work: Path, limits: SandboxLimits) -> dict[str, str]:
    bin_dir = os.path.dirname(sys.executable)
    path = os.pathsep.join([bin_dir, os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")])
    env = {"PATH": path, "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    for var in _THREAD_VARS:
        env[var] = str(limits.threads)
    if os.environ.get("VIRTUAL_ENV"):
        env["VIRTUAL_ENV"] = os.environ["VIRTUAL_ENV"]
    env.update(limits.env)
    return env


def isolation_available() -> dict[str, bool]:
    """Whether network and PID namespaces can be created here (they are used when they can)."""
    ok = _unshare_works()
    return {"network": ok, "pid_namespace": ok}


class _Prepared:
    """Directories, request file, environment and command of one sandboxed call.

    ``fork``: the call runs in a child of the fork server (its channel, if any, is passed to the
    zygote and kept as fd 3); otherwise in a fresh interpreter started from ``cmd``. ``channel``:
    a session (:func:`open_sandboxed`) with a socket pair between caller and target."""

    def __init__(self, target: str, args: tuple, kwargs: dict, limits: SandboxLimits, cwd: str | Path | None,
                 *, fork: bool = False, channel: bool = False):
        if not isinstance(target, str) or ":" not in target:
            raise ValueError(f"target must look like 'package.module:function', got {target!r}")
        try:
            args_json = json.loads(json.dumps(list(args)))
            kwargs_json = json.loads(json.dumps(kwargs))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"sandboxed call arguments must be JSON-serialisable: {exc}") from None
        self.limits = limits
        self.root = owned_tempdir("sandbox")
        self.own_cwd = cwd is None
        self.work = self.root / "work" if cwd is None else Path(cwd).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.io = self.root / "io"
        self.io.mkdir()
        self.use_ns = not limits.network and _unshare_works()
        self.stdout_path, self.stderr_path = self.io / "stdout", self.io / "stderr"
        self.result_path, self.enforced_path = self.io / "result.json", self.io / "enforced.json"
        sys_path = limits.python_path if limits.python_path is not None else [
            os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        self.sys_path = sys_path
        self.parent_end: socket.socket | None = None
        self.child_end: socket.socket | None = None
        if channel:
            self.parent_end, self.child_end = socket.socketpair()
        # The spawn path's supervisor watches this pipe: EOF means the caller (the only holder of
        # the write end, which is close-on-exec) has exited. The fork server has its own socket.
        self.lifeline_r: int | None = None
        self.lifeline_w: int | None = None
        if not fork:
            self.lifeline_r, self.lifeline_w = os.pipe()
        child_limits = limits.model_dump(include={"cpu_s", "memory_mb", "open_files", "file_size_mb",
                                                   "processes", "network"})
        child_limits["_own_user_ns"] = self.use_ns
        child_limits["_root_outside"] = hasattr(os, "geteuid") and os.geteuid() == 0
        request = {"target": target, "args": args_json, "kwargs": kwargs_json, "sys_path": sys_path,
                   "limits": child_limits, "result_path": str(self.result_path),
                   "enforced_path": str(self.enforced_path),
                   "deadline_s": limits.wall_s + SUPERVISOR_GRACE_S, "lifeline_fd": self.lifeline_r,
                   "channel_fd": None if self.child_end is None else (
                       _CHANNEL_FD if fork else self.child_end.fileno()),
                   "writable": [str(self.work), str(self.io)] + [str(Path(p).resolve()) for p in limits.writable_paths]}
        (self.io / "request.json").write_text(json.dumps(request))
        self.env = self._env()
        cmd = [sys.executable, "-I", _CHILD, str(self.io / "request.json")]
        if self.use_ns:
            # the interpreter's supervisor is PID 1 of the new PID namespace: when it exits, every
            # process in the namespace dies (--kill-child: so does it when unshare dies)
            cmd = [shutil.which("unshare") or "unshare", "-rn", "--pid", "--fork", "--kill-child"] + cmd
        self.cgroup = _make_cgroup(limits.processes) if limits.processes else None
        if self.cgroup is not None:
            # join the cgroup before anything else runs (the shell writes its own PID, then execs)
            cmd = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.cgroup)] + cmd
        self.cmd = cmd

    def pass_fds(self) -> list[int]:
        """Descriptors the spawned child inherits (at the same numbers)."""
        return [fd for fd in (self.lifeline_r, self.child_end.fileno() if self.child_end else None) if fd is not None]

    def close_child_fds(self) -> None:
        """The caller's copies of the child's ends, once the child (or the zygote) has its own."""
        if self.lifeline_r is not None:
            os.close(self.lifeline_r)
            self.lifeline_r = None
        if self.child_end is not None:
            self.child_end.close()
            self.child_end = None

    def _env(self) -> dict[str, str]:
        return _scrubbed_env(self.work, self.limits)

    def fork_message(self) -> dict[str, Any]:
        """What the fork server's child needs besides the request file (see ``_sandbox_child``)."""
        return {"request": str(self.io / "request.json"), "cwd": str(self.work), "env": self.env,
                "stdout": str(self.stdout_path), "stderr": str(self.stderr_path),
                "cgroup": str(self.cgroup) if self.cgroup is not None else None, "use_ns": self.use_ns,
                "deadline_s": self.limits.wall_s + SUPERVISOR_GRACE_S, "channel": self.child_end is not None}

    def open_outputs(self):
        return open(self.stdout_path, "wb"), open(self.stderr_path, "wb")

    def kill_group(self, pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _read_output(self, path: Path) -> str:
        n = self.limits.output_bytes
        try:
            size = path.stat().st_size
            with open(path, "rb") as fh:
                if size <= n:
                    data = fh.read()
                    return data.decode("utf-8", "replace")
                head = fh.read(n // 2)
                fh.seek(size - n // 2)
                tail = fh.read()
        except OSError:
            return ""
        return (head.decode("utf-8", "replace") + f"\n[truncated {size - len(head) - len(tail)} bytes]\n"
                + tail.decode("utf-8", "replace"))

    def finish(self, returncode: int | None, timed_out: bool, wall_s: float) -> SandboxResult:
        enforced: dict[str, bool] = {}
        try:
            enforced.update(json.loads(self.enforced_path.read_text()))
        except (OSError, ValueError):
            pass
        enforced["network"] = (not self.limits.network) and self.use_ns
        enforced["pid_namespace"] = self.use_ns
        enforced["wall_clock"] = True
        enforced["wall_clock_inside"] = True  # the supervisor's deadline, with or without the caller
        enforced["dies_with_caller"] = True
        if self.cgroup is not None:
            enforced["processes"] = True
        notes: list[str] = []
        if not self.limits.network and not self.use_ns:
            notes.append("network not isolated: user namespaces (unshare -rn) are unavailable here"
                         + ("; TCP bind/connect denied by Landlock" if enforced.get("landlock_network") else ""))
        if self.limits.processes and not enforced.get("processes"):
            notes.append("process count not limited (RLIMIT_NPROC needs an own user namespace and a non-root "
                         "user); the PID namespace and the wall clock still end every process")
        if not enforced.get("filesystem"):
            notes.append("writes outside the sandbox directory not prevented (no Landlock)")
        common: dict[str, Any] = dict(stdout=self._read_output(self.stdout_path), stderr=self._read_output(self.stderr_path),
                      wall_s=wall_s, enforced=enforced, notes=notes, returncode=returncode)
        sig = None
        if returncode is not None:
            if returncode < 0:
                sig = -returncode
            elif returncode > 128:
                sig = returncode - 128  # the supervisor reports a signalled worker as 128 + N
        common["signal"] = signal.Signals(sig).name if sig and sig in signal.Signals._value2member_map_ else None
        if timed_out:
            return SandboxResult(status="timeout", error_type="Timeout",
                                 error_message=f"wall-clock limit of {self.limits.wall_s:g} s exceeded; process group killed",
                                 **common)
        data = None
        try:
            if self.result_path.stat().st_size > self.limits.result_bytes:
                return SandboxResult(status="error", error_type="ResultTooLarge",
                                     error_message=f"result over {self.limits.result_bytes} bytes", **common)
            data = bounded_json_loads(self.result_path.read_bytes())
        except OSError:
            data = None
        except ValueError as exc:  # JSON the target (or code it runs) wrote: malformed, or nested to crash us
            return SandboxResult(status="error", error_type="InvalidResult", error_message=str(exc), **common)
        if data is not None and not isinstance(data, dict):
            return SandboxResult(status="error", error_type="InvalidResult", error_message="result is not an object",
                                 **common)
        if data is not None:
            usage = {k: data.get(k) if isinstance(data.get(k), (int, float)) else None for k in ("cpu_s", "max_rss_mb")}
            common.update(usage)
            if data.get("status") == "ok":
                try:
                    value = bounded_json_loads(data["value_json"]) if isinstance(data.get("value_json"), str) else None
                except ValueError as exc:
                    return SandboxResult(status="error", error_type="InvalidResult", error_message=str(exc), **common)
                return SandboxResult(status="ok", value=value, **common)
            status = data.get("status", "error")
            if status not in ("error", "memory_exceeded"):
                status = "error"
            msg = str(data.get("error_message") or "")[:4000]
            if status == "error" and ("can't allocate memory" in msg or "std::bad_alloc" in msg):
                status = "memory_exceeded"
            tb = data.get("traceback_tail")
            return SandboxResult(status=status, error_type=str(data.get("error_type"))[:200], error_message=msg,
                                 traceback_tail=str(tb)[-4000:] if tb is not None else None, **common)
        # No result: the process died before it could report.
        tail = common["stderr"][-2000:]
        kind: Status
        if sig in (signal.SIGXCPU,) or (sig == signal.SIGKILL and self.limits.cpu_s and "cpu" in enforced):
            kind = "killed"
            message = (f"killed by {common['signal']}: CPU time limit ({self.limits.cpu_s:g} s) exceeded"
                       if sig == signal.SIGXCPU else f"killed by {common['signal']} (CPU or memory limit, or OOM killer)")
        elif sig == signal.SIGXFSZ:
            kind, message = "killed", f"killed by SIGXFSZ: file size limit ({self.limits.file_size_mb} MB) exceeded"
        elif sig is not None and sig in _CRASH_SIGNALS:
            kind, message = "crashed", f"crashed with {common['signal']}"
        elif sig is not None:
            kind, message = "killed", f"killed by {common['signal']}"
        else:
            kind, message = "crashed", f"exited with code {returncode} before reporting a result"
        if "MemoryError" in tail or "bad_alloc" in tail or "can't allocate memory" in tail:
            kind = "memory_exceeded"
        return SandboxResult(status=kind, error_type=kind, error_message=message, traceback_tail=tail or None, **common)

    def cleanup(self) -> None:
        self.close_child_fds()
        for sock in (self.parent_end,):
            if sock is not None:
                sock.close()
        if self.lifeline_w is not None:
            os.close(self.lifeline_w)
            self.lifeline_w = None
        _remove_cgroup(self.cgroup)
        shutil.rmtree(self.root, ignore_errors=True)


class _ForkCall:
    def __init__(self) -> None:
        self.started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.exited: concurrent.futures.Future[int] = concurrent.futures.Future()


class _ForkServer:
    """A zygote (``_sandbox_child.py --zygote``) that imported ``preload`` and forks one child per
    call. It runs trusted code only; see the security notes in ``_sandbox_child``."""

    def __init__(self, preload: tuple[str, ...], sys_path: list[str], limits: SandboxLimits):
        self.home = owned_tempdir("zygote")
        ours, theirs = socket.socketpair()
        config = {"sys_path": sys_path, "preload": list(preload)}
        self._log = open(self.home / "zygote.log", "wb")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", _CHILD, "--zygote", str(theirs.fileno()), json.dumps(config)],
                pass_fds=[theirs.fileno()], env=_scrubbed_env(self.home, limits), cwd=self.home,
                stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log, start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours
        self._file = ours.makefile("rb")
        self._lock = threading.Lock()
        self._calls: dict[int, _ForkCall] = {}
        self._next = 0
        self.dead = False
        line = self._file.readline()  # the zygote says it is ready once the preloads are imported
        if not line:
            log = (self.home / "zygote.log").read_text(errors="replace")[-2000:]
            self.close()
            raise RuntimeError(f"sandbox fork server failed to start (preload {list(preload)}): {log}")
        self.info = json.loads(line)
        threading.Thread(target=self._reader, name="sandbox-fork-server", daemon=True).start()

    def _reader(self) -> None:
        try:
            for line in self._file:
                msg = json.loads(line)
                call = self._calls.get(msg["id"])
                if call is None:
                    continue
                if "pid" in msg:
                    call.started.set_result(msg["pid"])
                elif "exit" in msg:
                    self._calls.pop(msg["id"], None)
                    call.exited.set_result(msg["exit"])
        except (OSError, ValueError):
            pass
        self.dead = True
        for call in list(self._calls.values()):
            for fut in (call.started, call.exited):
                if not fut.done():
                    fut.set_exception(RuntimeError("the sandbox fork server exited"))

    def submit(self, message: dict[str, Any], fds: Sequence[int] = ()) -> _ForkCall:
        """Ask for one fork; ``fds`` (a session's channel) travel with the message (SCM_RIGHTS)."""
        call = _ForkCall()
        with self._lock:
            if self.dead:
                raise RuntimeError("the sandbox fork server exited")
            self._next += 1
            self._calls[self._next] = call
            data = (json.dumps({"id": self._next, **message}) + "\n").encode()
            sent = socket.send_fds(self.sock, [data], list(fds)) if fds else 0
            self.sock.sendall(data[sent:])
        return call

    def close(self) -> None:
        self.dead = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the zygote sees EOF, kills what is left and exits
        except OSError:
            pass
        self.sock.close()
        self._file.close()  # the socket's descriptor is released once its file object is closed too
        try:
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self._log.close()
        shutil.rmtree(self.home, ignore_errors=True)


_SERVERS: dict[tuple, _ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def _fork_server(preload: tuple[str, ...], sys_path: list[str], limits: SandboxLimits) -> _ForkServer:
    key = (preload, tuple(sys_path), limits.threads, tuple(sorted(limits.env.items())))
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None or server.dead or server.proc.poll() is not None:
            if server is not None:
                server.close()
            server = _SERVERS[key] = _ForkServer(preload, sys_path, limits)
        return server


@atexit.register
def shutdown_fork_servers() -> None:
    """Stop every fork server this process started (also run at exit)."""
    with _SERVERS_LOCK:
        for server in _SERVERS.values():
            server.close()
        _SERVERS.clear()


def _kill_forked(prep: "_Prepared", pid: int | None, exited: bool) -> None:
    if pid is None:
        return
    prep.kill_group(pid)
    if not exited:  # before its setsid the child is not yet a group leader
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _server_died(prep: "_Prepared", wall_s: float) -> SandboxResult:
    res = prep.finish(None, False, wall_s)
    res.status, res.error_type = "error", "ForkServerDied"
    res.error_message = "the sandbox fork server exited during the call (infrastructure error, not the target's)"
    return res


def _run_forked(prep: "_Prepared", preload: tuple[str, ...]) -> SandboxResult:
    server = _fork_server(preload, prep.sys_path, prep.limits)
    start = time.perf_counter()
    call = server.submit(prep.fork_message())
    pid: int | None = None
    try:
        pid = call.started.result(timeout=60)
        timed_out = False
        try:
            code = call.exited.result(timeout=max(0.0, prep.limits.wall_s - (time.perf_counter() - start)))
        except concurrent.futures.TimeoutError:
            timed_out = True
            _kill_forked(prep, pid, False)
            code = call.exited.result(timeout=60)
    except RuntimeError:
        _kill_forked(prep, pid, False)
        return _server_died(prep, time.perf_counter() - start)
    except BaseException:
        _kill_forked(prep, pid, call.exited.done())
        raise
    _kill_forked(prep, pid, True)  # whatever the target left behind in its group
    return prep.finish(code, timed_out, time.perf_counter() - start)


async def _arun_forked(prep: "_Prepared", preload: tuple[str, ...]) -> SandboxResult:
    server = await asyncio.to_thread(_fork_server, preload, prep.sys_path, prep.limits)
    start = time.perf_counter()
    call = server.submit(prep.fork_message())
    pid: int | None = None
    try:
        pid = await asyncio.wait_for(asyncio.wrap_future(call.started), timeout=60)
        exited = asyncio.wrap_future(call.exited)
        timed_out = False
        try:
            code = await asyncio.wait_for(asyncio.shield(exited),
                                          timeout=max(0.0, prep.limits.wall_s - (time.perf_counter() - start)))
        except asyncio.TimeoutError:
            timed_out = True
            _kill_forked(prep, pid, False)
            code = await asyncio.wait_for(exited, timeout=60)
    except RuntimeError:
        _kill_forked(prep, pid, False)
        return _server_died(prep, time.perf_counter() - start)
    except BaseException:  # cancelled: stop the work, then let the cancellation through
        _kill_forked(prep, pid, call.exited.done())
        raise
    _kill_forked(prep, pid, True)
    return prep.finish(code, timed_out, time.perf_counter() - start)


def run_sandboxed(target: str, /, *args: Any, limits: SandboxLimits | None = None,
                  cwd: str | Path | None = None, preload: Sequence[str] | None = None,
                  **kwargs: Any) -> SandboxResult:
    """Call ``target(*args, **kwargs)`` in a sandboxed child process and wait for it.

    Arguments and the return value must be JSON-serialisable (pydantic models are dumped).
    ``preload`` (module names) runs the call in a child forked from a fork server that imported
    those trusted modules once (one server per preload, ``sys.path``, threads and extra env),
    instead of a fresh interpreter: same limits and isolation, without the import cost.
    ``cwd`` gives the child an existing working directory instead of a fresh temporary one
    (it is then writable and kept).
    """
    limits = limits or SandboxLimits()
    prep = _Prepared(target, args, kwargs, limits, cwd, fork=preload is not None)
    try:
        if preload is not None:
            return _run_forked(prep, tuple(preload))
        out, err = prep.open_outputs()
        start = time.perf_counter()
        with out, err:
            proc = subprocess.Popen(prep.cmd, cwd=prep.work, env=prep.env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True, close_fds=True,
                                    pass_fds=prep.pass_fds())
        prep.close_child_fds()
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BaseException:
            prep.kill_group(proc.pid)
            proc.wait()
            raise
        prep.kill_group(proc.pid)  # whatever the target left behind in its group
        proc.wait()
        return prep.finish(proc.returncode, timed_out, time.perf_counter() - start)
    finally:
        prep.cleanup()


async def arun_sandboxed(target: str, /, *args: Any, limits: SandboxLimits | None = None,
                         cwd: str | Path | None = None, preload: Sequence[str] | None = None,
                         **kwargs: Any) -> SandboxResult:
    """Async :func:`run_sandboxed`. Cancelling the awaiting task kills the child's process group."""
    limits = limits or SandboxLimits()
    prep = _Prepared(target, args, kwargs, limits, cwd, fork=preload is not None)
    try:
        if preload is not None:
            return await _arun_forked(prep, tuple(preload))
        out, err = prep.open_outputs()
        start = time.perf_counter()
        with out, err:
            proc = await asyncio.create_subprocess_exec(*prep.cmd, cwd=prep.work, env=prep.env,
                                                        stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                                        start_new_session=True, pass_fds=prep.pass_fds())
        prep.close_child_fds()
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout=limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
        except BaseException:  # cancelled: stop the work, then let the cancellation through
            prep.kill_group(proc.pid)
            await asyncio.shield(proc.wait())
            raise
        prep.kill_group(proc.pid)
        await proc.wait()
        return prep.finish(proc.returncode, timed_out, time.perf_counter() - start)
    finally:
        prep.cleanup()


class SandboxSession:
    """A sandboxed call kept running while the caller talks to it over ``channel`` (see
    :func:`open_sandboxed`). ``pid`` is the sandbox's root process (a host PID): the target runs
    in one of its descendants (:func:`process_tree`). The wall clock runs from the start."""

    def __init__(self, prep: _Prepared, preload: tuple[str, ...] | None):
        self._prep, self._preload = prep, preload
        assert prep.parent_end is not None
        self.channel: socket.socket = prep.parent_end
        self.pid: int | None = None
        self._start = 0.0
        self._exited: asyncio.Future[Any] | None = None
        self._watch: asyncio.Task[tuple[int | None, bool]] | None = None
        self._result: SandboxResult | None = None

    async def _launch(self) -> None:
        prep = self._prep
        if self._preload is not None:
            server = await asyncio.to_thread(_fork_server, self._preload, prep.sys_path, prep.limits)
            assert prep.child_end is not None
            self._start = time.perf_counter()
            call = server.submit(prep.fork_message(), fds=[prep.child_end.fileno()])
            prep.close_child_fds()
            self._exited = asyncio.wrap_future(call.exited)
            self.pid = await asyncio.wait_for(asyncio.wrap_future(call.started), timeout=60)
        else:
            out, err = prep.open_outputs()
            self._start = time.perf_counter()
            with out, err:
                proc = await asyncio.create_subprocess_exec(*prep.cmd, cwd=prep.work, env=prep.env,
                                                            stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                                            start_new_session=True, pass_fds=prep.pass_fds())
            prep.close_child_fds()
            self.pid = proc.pid
            self._exited = asyncio.ensure_future(proc.wait())
        self._watch = asyncio.create_task(self._watchdog())

    async def _watchdog(self) -> tuple[int | None, bool]:
        assert self._exited is not None
        left = self._prep.limits.wall_s - (time.perf_counter() - self._start)
        try:
            try:
                return await asyncio.wait_for(asyncio.shield(self._exited), timeout=max(0.0, left)), False
            except asyncio.TimeoutError:
                self.kill()
                return await self._exited, True
        except RuntimeError:  # the fork server died under us
            return None, False

    @property
    def running(self) -> bool:
        return self._exited is not None and not self._exited.done()

    def kill(self) -> None:
        """SIGKILL the sandbox (its group, and the PID namespace with it)."""
        if self.pid is None:
            return
        if self._preload is not None:
            _kill_forked(self._prep, self.pid, self._exited is not None and self._exited.done())
        else:
            self._prep.kill_group(self.pid)

    async def result(self) -> SandboxResult:
        """Wait for the end (within the wall clock) and say how it ended."""
        if self._result is None:
            assert self._watch is not None
            code, timed_out = await self._watch
            self.kill()  # whatever the target left behind in its group
            res = self._prep.finish(code, timed_out, time.perf_counter() - self._start)
            if code is None and not timed_out:
                res.status, res.error_type = "error", "ForkServerDied"
                res.error_message = "the sandbox fork server exited during the call (infrastructure error)"
            self._result = res
        return self._result

    async def close(self, grace_s: float = 0.0) -> SandboxResult:
        """End the session and return its result: close the channel (a target that serves it
        returns), give the target ``grace_s`` to exit on its own, then kill what still runs."""
        if self.running and grace_s > 0:
            try:
                self.channel.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            assert self._exited is not None
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), timeout=grace_s)
            except (asyncio.TimeoutError, RuntimeError):
                pass
        if self.running:
            self.kill()
        return await self.result()


@contextlib.asynccontextmanager
async def open_sandboxed(target: str, /, *args: Any, limits: SandboxLimits | None = None,
                         preload: Sequence[str] | None = None, **kwargs: Any) -> AsyncIterator[SandboxSession]:
    """Start ``target(*args, channel_fd=FD, **kwargs)`` in a sandbox and keep it running while the
    caller talks to it over ``session.channel`` (a connected socket; the target's end is ``FD``).

    Same limits and isolation as :func:`run_sandboxed` (``preload``: forked from a fork server).
    Leaving the block kills the sandbox if it still runs; ``await session.result()`` inside it
    waits for the target to return instead. Why: an evaluation that must not share a process
    with the code it judges (KernelBench) drives that code call by call from outside.
    """
    limits = limits or SandboxLimits()
    prep = _Prepared(target, args, kwargs, limits, None, fork=preload is not None, channel=True)
    session = SandboxSession(prep, tuple(preload) if preload is not None else None)
    try:
        await session._launch()
        yield session
    finally:
        try:
            if session._watch is not None:
                await session.close()
            elif session.pid is not None:
                session.kill()
        finally:
            prep.cleanup()
