"""The sandboxed side of :mod:`closedloop.sandbox` (stdlib only; runs before any target code).

Run as ``python -I _sandbox_child.py REQUEST.json``. The process forks: the parent stays a
supervisor that runs no target code (PID 1 of the sandbox's PID namespace when there is one) and
the child applies the limits to itself (rlimits, Landlock write confinement), imports
``package.module:function``, calls it and writes a JSON result next to the request. The parent
never unpickles anything from here: JSON only.

Why a supervisor: sandboxed work must not outlive its caller nor run without a clock when the
caller is gone (SIGKILLed, SIGTERMed, hung). The supervisor kills the work when the wall-clock
deadline passes (enforced here, not only by the caller) and when the caller's lifeline pipe
reports EOF (every process holding its write end, i.e. the caller, has exited).

The worker ends with ``os._exit`` so that threads a hostile target left behind cannot keep the
interpreter alive after the result is written.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import inspect
import json
import os
import resource
import signal
import sys
import time
import traceback

# Landlock (Linux >= 5.13): confine writes to the working directories. Reads stay allowed:
# the interpreter, torch and compilers must read the whole system.
_WRITE_FILE = 1 << 1
_FS_WRITE_RIGHTS_V1 = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove, make*
_REFER = 1 << 13  # ABI 2
_TRUNCATE = 1 << 14  # ABI 3
_NET_BIND, _NET_CONNECT = 1 << 0, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock(writable: list[str], deny_network: bool) -> dict[str, bool]:
    """Restrict this process (and its descendants) to writing under ``writable``; optionally deny
    TCP bind/connect and signals/abstract sockets outside the sandbox. Returns what was enforced."""
    done = {"filesystem": False, "landlock_network": False}
    if not sys.platform.startswith("linux"):
        return done
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return done
    fs = _FS_WRITE_RIGHTS_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    net = (_NET_BIND | _NET_CONNECT) if (deny_network and abi >= 4) else 0
    scoped = (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0
    attr = _RulesetAttr(fs, net, scoped)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 16
    fd = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        return done
    try:
        for path in writable + ["/dev/null"]:
            if not os.path.exists(path):
                continue
            is_dir = os.path.isdir(path)
            rights = fs if is_dir else (_WRITE_FILE | (_TRUNCATE if abi >= 3 else 0))
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(rights, pfd)
                libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(pfd)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, required by restrict_self
            return done
        if libc.syscall(_SYS_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            return done
    finally:
        os.close(fd)
    done["filesystem"] = True
    done["landlock_network"] = bool(net)
    return done


def _set_rlimits(limits: dict) -> dict[str, bool]:
    done: dict[str, bool] = {}

    def setl(res: int, soft: int, hard: int | None = None) -> bool:
        try:
            cur_soft, cur_hard = resource.getrlimit(res)
            hard = soft if hard is None else hard
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            resource.setrlimit(res, (soft, hard))
            return True
        except (ValueError, OSError):
            return False

    if limits.get("memory_mb"):
        done["memory"] = setl(resource.RLIMIT_AS, int(limits["memory_mb"]) << 20)
    if limits.get("cpu_s"):
        s = max(1, int(limits["cpu_s"] + 0.999))
        done["cpu"] = setl(resource.RLIMIT_CPU, s, s + 1)  # SIGXCPU, then SIGKILL one second later
    if limits.get("open_files"):
        done["open_files"] = setl(resource.RLIMIT_NOFILE, int(limits["open_files"]))
    if limits.get("file_size_mb"):
        done["file_size"] = setl(resource.RLIMIT_FSIZE, int(limits["file_size_mb"]) << 20)
    if limits.get("processes"):
        # RLIMIT_NPROC counts every task of the user in the current user namespace: meaningful
        # (a cap on this sandbox alone) only inside our own user namespace.
        # Real root is exempt from RLIMIT_NPROC, so it is not counted as enforced there.
        if limits.get("_own_user_ns") and not limits.get("_root_outside"):
            done["processes"] = setl(resource.RLIMIT_NPROC, int(limits["processes"]))
        else:
            done["processes"] = False
    return done


def _resolve(target: str):
    if ":" not in target:
        raise ValueError(f"target {target!r} must look like 'package.module:function'")
    mod_name, _, attr = target.partition(":")
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    fn = getattr(obj, "fn", None)  # a closedloop.tool.Tool: call the plain function
    if fn is not None and callable(fn):
        obj = fn
    if not callable(obj):
        raise TypeError(f"target {target!r} is not callable")
    return obj


def _jsonable(value):
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        value = dump(mode="json")
    return json.dumps(value, allow_nan=True)


def _usage() -> dict:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    rc = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"cpu_s": ru.ru_utime + ru.ru_stime + rc.ru_utime + rc.ru_stime,
            "max_rss_mb": max(ru.ru_maxrss, rc.ru_maxrss) / 1024.0}


def main() -> None:
    if sys.argv[1] == "--zygote":
        zygote_main(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        launch(sys.argv[1])


def launch(request_path: str) -> None:
    """Spawn path: fork the worker and supervise it (see the module docstring). Never returns."""
    with open(request_path) as fh:
        req = json.load(fh)
    supervisor = os.getpid()
    worker = os.fork()
    if worker == 0:
        _die_with_parent(supervisor)
        run_request(request_path)
    if req.get("channel_fd") is not None:
        os.close(int(req["channel_fd"]))  # the worker's; a copy here would hide its exit from the caller
    os._exit(supervise(worker, req.get("deadline_s"), req.get("lifeline_fd")))


def supervise(child: int, deadline_s: float | None, lifeline: int | None) -> int:
    """Wait for ``child`` (reaping any other child meanwhile, as a PID 1 must) and return its
    shell-style exit code (128 + N when signal N killed it). Kill it when ``deadline_s`` passes or
    when ``lifeline`` (a pipe's read end) reports EOF: the caller, the only holder of the write
    end, has exited. Outside a PID namespace the whole process group is killed too (this
    process included), since the namespace's teardown is not there to do it."""
    import select

    rd, wr = os.pipe()
    os.set_blocking(rd, False)
    os.set_blocking(wr, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wr)
    end = None if deadline_s is None else time.monotonic() + float(deadline_s)
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return 127
            if pid == 0:
                break
            if pid == child:
                return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            return _kill_supervised(child)
        fds = [rd] + ([lifeline] if lifeline is not None else [])
        try:
            ready = select.select(fds, [], [], left)[0]
        except InterruptedError:
            continue
        if lifeline is not None and lifeline in ready:
            try:
                data = os.read(lifeline, 64)
            except OSError:
                data = b""
            if not data:
                return _kill_supervised(child)
        if rd in ready:
            try:
                os.read(rd, 4096)
            except BlockingIOError:
                pass


def _kill_supervised(child: int) -> int:
    try:
        os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if os.getpid() != 1:  # no PID namespace to tear down: the group goes, this process with it
        try:
            os.killpg(0, signal.SIGKILL)
        except OSError:
            pass
    return 128 + signal.SIGKILL


def run_request(request_path: str) -> None:
    """Apply the limits to this process, run the target, write the JSON result, ``os._exit``."""
    main_pid = os.getpid()
    with open(request_path) as fh:
        req = json.load(fh)
    if req.get("lifeline_fd") is not None:
        try:
            os.close(int(req["lifeline_fd"]))  # the supervisor watches it; the target has no use for it
        except OSError:
            pass
    result_path = req["result_path"]
    enforced = _set_rlimits(req["limits"])
    enforced.update(_landlock(req["writable"], deny_network=not req["limits"].get("network", False)))
    with open(req["enforced_path"], "w") as fh:
        json.dump(enforced, fh)
    sys.path[:] = [p for p in req["sys_path"]]
    out: dict
    try:
        fn = _resolve(req["target"])
        kwargs = dict(req["kwargs"])
        if req.get("channel_fd") is not None:
            kwargs["channel_fd"] = int(req["channel_fd"])
        value = fn(*req["args"], **kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_await(value))
        out = {"status": "ok", "value_json": _jsonable(value)}
    except BaseException as exc:  # noqa: BLE001 - every failure of untrusted code is a result
        tb = traceback.format_exc()
        status = "memory_exceeded" if isinstance(exc, MemoryError) else "error"
        out = {"status": status, "error_type": type(exc).__name__, "error_message": str(exc)[:4000],
               "traceback_tail": tb[-4000:]}
    out.update(_usage())
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    if os.getpid() != main_pid:  # a fork of the target: only the original process reports
        os._exit(0)
    tmp = result_path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(out))
    os.replace(tmp, result_path)
    os._exit(0)


async def _await(aw):
    return await aw


# ---------------------------------------------------------------------------------------------
# Fork server ("zygote"). Why: a fresh interpreter spends ~2 s importing torch before a
# KernelBench evaluation can start. The zygote imports the trusted modules once and forks one
# child per call. Why this keeps the guarantees of the fresh-interpreter path:
# - the zygote never runs target code: it only imports the named (trusted) modules, then loops
#   reading requests from its control socket, forking and reaping; every child is single-use
#   and exits with os._exit, so nothing a target does reaches the zygote or a later call;
# - the child closes every inherited descriptor (the control socket included; a session's
#   channel, passed with the request, is kept as fd 3) before it applies any limit or runs the
#   target, so a target cannot ask the zygote for anything;
# - the child applies the same isolation as the spawn path, in the same order: own session,
#   the pids cgroup, new user + network + PID namespaces (unshare(2) directly; the PID
#   namespace's init is a small reaper), the scrubbed environment, rlimits, Landlock;
# - the child (C1) stays a supervisor, as in the spawn path: it kills the work at the wall-clock
#   deadline even if the caller is gone, and dies with the zygote (PR_SET_PDEATHSIG), which
#   exits as soon as its caller's end of the control socket closes.
# ---------------------------------------------------------------------------------------------

_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_PR_SET_PDEATHSIG = 1
CHANNEL_FD = 3  # where a forked child keeps a session's channel


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _die_with_parent(parent: int | None) -> None:
    """SIGKILL when the forking process dies; exit now if it already has (the race prctl leaves).
    ``parent`` None: no check (the init of a new PID namespace sees its parent as PID 0; it shares
    the supervisor's process group, which every kill from outside targets)."""
    _libc().prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(125)


def _enter_namespaces() -> None:
    """``unshare -rn --pid``: own user namespace (mapped to our uid as root), no network, and a
    PID namespace whose first child becomes its init."""
    uid, gid = os.getuid(), os.getgid()
    libc = _libc()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare(user, net, pid) failed")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as fh:
            fh.write(text)


def _wait_code(pid: int) -> int:
    """Wait for ``pid`` (reaping any other child meanwhile, as an init must); shell-style code."""
    while True:
        try:
            got, status = os.wait()
        except ChildProcessError:
            return 127
        if got == pid:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.WEXITSTATUS(status)


def _fork_child(msg: dict, channel: int | None, zygote: int) -> None:
    """In the forked child (C1). Never returns."""
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        _die_with_parent(zygote)
        fd_in = os.open(os.devnull, os.O_RDONLY)
        fd_out = os.open(msg["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        fd_err = os.open(msg["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for src, dst in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
            os.dup2(src, dst)
        if channel is not None:
            os.dup2(channel, CHANNEL_FD)
        # the control socket first of all: the target must not reach the zygote
        os.closerange(CHANNEL_FD + (channel is not None), 1 << 16)
        if msg.get("cgroup"):
            with open(os.path.join(msg["cgroup"], "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))
        os.environ.clear()
        os.environ.update(msg["env"])
        os.chdir(msg["cwd"])
        import tempfile

        tempfile.tempdir = None  # recomputed from the child's TMPDIR
        sys.argv = ["sandbox"]
        if msg.get("use_ns"):
            _enter_namespaces()
        supervisor = os.getpid()
        child = os.fork()  # PID 1 of the new namespace when there is one
        if child:
            if channel is not None:
                os.close(CHANNEL_FD)
            os._exit(supervise(child, msg.get("deadline_s"), None))
        _die_with_parent(None if msg.get("use_ns") else supervisor)
        if msg.get("use_ns"):
            worker = os.fork()
            if worker:  # init: reaps orphans; when it exits the kernel ends the whole namespace
                if channel is not None:
                    os.close(CHANNEL_FD)
                os._exit(_wait_code(worker))
            _die_with_parent(1)
        run_request(msg["request"])
    except BaseException as exc:  # noqa: BLE001 - the setup failed: say so on stderr, no result
        try:
            os.write(2, f"sandbox fork-server child setup failed: {type(exc).__name__}: {exc}\n".encode())
        finally:
            os._exit(125)
    os._exit(0)


def zygote_main(sock_fd: int, config: dict) -> None:
    """Serve fork requests (one JSON line each, a session's channel passed alongside with
    SCM_RIGHTS) on ``sock_fd`` until it closes or the caller exits."""
    import select
    import socket

    caller, zygote = os.getppid(), os.getpid()
    sys.path[:] = list(config["sys_path"])
    for name in config.get("preload", []):
        importlib.import_module(name)
    sock = socket.socket(fileno=sock_fd)
    rd, wr = os.pipe()
    os.set_blocking(wr, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wr)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    sock.sendall((json.dumps({"ready": True, "pid": os.getpid(), "threads": threads}) + "\n").encode())
    running: dict[int, int] = {}
    buf = b""
    fds: list[int] = []

    def stop() -> None:  # the caller is gone: end what is left, then this server
        for pid in running:
            try:
                os.killpg(pid, 9)
            except OSError:
                pass
        os._exit(0)

    while True:
        try:
            ready = select.select([sock.fileno(), rd], [], [], 1.0)[0]
        except InterruptedError:
            ready = []
        if os.getppid() != caller:
            stop()
        if rd in ready:
            try:
                os.read(rd, 4096)
            except BlockingIOError:
                pass
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            call = running.pop(pid, None)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            if call is not None:
                sock.sendall((json.dumps({"id": call, "exit": code}) + "\n").encode())
        if sock.fileno() in ready:
            data, got, _, _ = socket.recv_fds(sock, 1 << 20, 16)
            fds += got
            if not data:  # the parent closed the socket (or exited)
                stop()
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                channel = fds.pop(0) if msg.get("channel") and fds else None
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _fork_child(msg, channel, zygote)
                if channel is not None:
                    os.close(channel)
                running[pid] = msg["id"]
                sock.sendall((json.dumps({"id": msg["id"], "pid": pid}) + "\n").encode())


if __name__ == "__main__":
    main()
