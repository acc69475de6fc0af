"""The judge: drives a reference process and a candidate process, and decides, out of their reach.

Three sandboxes (``serve.py``), each forked from the fork server, each with its own arena:

- the *inputs* process loads the problem and draws every call's inputs (from seeds the candidate
  never sees);
- the *reference* process loads the problem, computes the reference outputs and is timed;
- the *candidate* process loads only the candidate and runs ``ModelNew`` on inputs it is given.

The reference and the candidate processes do the very same work between their forwards, so
neither comes to its turn warmer than the other (drawing inputs in the reference process made it
15-20% faster on small problems). They are pinned to the same CPUs and take turns (two virtual
CPUs of a shared machine can differ in speed for minutes); the inputs process and the parent's
thread keep to the other CPUs where there are others.

The parent never runs candidate code. For each batch of calls, and for each side in turn (seeded
beforehand), it reads the side's CPU clock (the kernel's account of the process, all its threads,
read from outside), writes the inputs into the side's arena, times *go* (the forwards) and
*collect* (the outputs written out) on that CPU clock and on its own wall clock, reads the
outputs from the arena and checks that the inputs were not modified, and only then reads the CPU
clock again: whatever the side does with its inputs, early or late, is counted. CPU the
candidate spends outside its turns (an honest one waits for its next request) is a policy
violation: that is how it could slow the reference down. After every batch the parent also checks
from outside (``/proc``) that the candidate started no process, ran no child, runs no more
threads than allowed and kept its CPUs. It compares the outputs itself (``compare.py``) and
computes the timings (``timing.py``). Nothing the candidate writes reaches the reference, the
comparison or the clock.

Every call has inputs of its own, timed calls included, so a value-keyed cache never hits; the
trials and the final call are drawn after the candidate's outputs for the calls before them were
received (timed batches are drawn a few ahead, while others run). Plan: ``warmup`` calls (they
size the timed batches), ``trials`` calls on three input distributions (KernelBench's correctness
trials), ``iters`` timed batches (again if the speedup's interval is too wide), one final call.
A timed batch is ``n`` calls run back to back in one request, ``n`` chosen so the reference works
``batch_ms`` per batch: the request round trips would otherwise swamp the forwards of small
problems. Every output of a batch is checked for structure, shape and dtype, and two of them,
picked by a generator the candidate never observes, for values; the warm-up, the trials and the
final call are checked in full.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from closedloop.evals.kernelbench import wire
from closedloop.evals.kernelbench.compare import Verdict, check_layout, compare
from closedloop.evals.kernelbench.timing import CallTime, credited, speedup_interval, speedups, stats
from closedloop.sandbox import SandboxLimits, SandboxResult, SandboxSession, open_sandboxed, process_tree, task_count

SERVE = "closedloop.evals.kernelbench.serve:serve"
SERVE_MODULE = "closedloop.evals.kernelbench.serve"
_TORCH_DTYPES = {name: getattr(torch, name) for name in wire.DTYPES}
_SEED_BITS = 31
MAX_BATCH = 128  # calls per timed batch (each has inputs of its own: drawing them is the cost)
MAX_BATCH_BYTES = 64 << 20  # inputs and outputs of one timed batch
GEN_CHUNK_BYTES = 32 << 20  # inputs drawn in one request (up to 8 batches ahead)
RETIME_REACH = 1.5  # re-time when the interval is at most this many times too wide
CLOSE_GRACE_S = 2.0  # for a sandbox to return once its channel is closed
#: CPU the candidate may spend outside its turns: a little, for the return to its request loop.
IDLE_CPU_MS = 20.0
IDLE_CPU_SHARE = 0.05


@dataclass
class JudgeRequest:
    problem_code: str
    candidate_code: str
    extensions: dict[str, str] = field(default_factory=dict)
    build_settings: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    seed: int = 42
    input_seed: int | None = None
    trials: int = 5
    warmup: int = 3
    iters: int = 20
    atol: float = 1e-2
    rtol: float = 1e-2
    threads: int = 1
    timing: bool = True
    compile_reference: bool = False
    profile: bool = False
    max_uncertainty: float = 0.15
    retime: bool = True
    batch_ms: float = 2.0  # reference work per timed batch (see _Conversation._batch_size)


class _PeerDied(Exception):
    def __init__(self, peer: "_Peer", during: str):
        super().__init__(f"{peer.name} closed its channel during {during}")
        self.peer, self.during = peer, during


class _Peer:
    """One sandboxed process, as the parent sees and drives it."""

    def __init__(self, name: str, session: SandboxSession, deadline: float):
        self.name, self.session, self.deadline = name, session, deadline
        self.arena = wire.Arena(1 << 20)
        self.worker: int | None = None
        self.pids: set[int] = set()
        self.layout: list[Any] = []  # the input slots it holds tensors over (see serve.prepare)
        self.seeded: int | None = None  # the seed torch was last given (see serve.collect)
        self.last_cpu = 0  # its CPU clock when its last turn ended
        self.base_children_cpu = 0
        self._cpu = 0

    @property
    def trusted(self) -> bool:
        return self.name != "candidate"

    def request(self, msg: dict[str, Any], during: str, fds: list[int] | None = None) -> dict[str, Any]:
        try:
            wire.send(self.session.channel, msg, fds)
            return wire.recv(self.session.channel, deadline=self.deadline)
        except (wire.ChannelClosed, BrokenPipeError, ConnectionResetError):
            raise _PeerDied(self, during) from None
        except wire.ChannelTimeout:
            raise Verdict("timeout", f"the {self.name} did not answer in time during {during}") from None
        except wire.ProtocolError as exc:
            if self.trusted:
                raise
            raise Verdict("invalid_output", f"{during}: the candidate process sent {exc}") from None

    def hello(self) -> None:
        try:
            msg = wire.recv(self.session.channel, deadline=self.deadline)
        except wire.ChannelClosed:
            raise _PeerDied(self, "start-up") from None
        if msg.get("op") != "hello":
            raise RuntimeError(f"the {self.name} process did not start properly: {msg}")
        # No code of the problem or the candidate has run yet: the tree is ours, and its leaf
        # is the process that will run it.
        assert self.session.pid is not None
        tree = process_tree(self.session.pid)
        leaves = [p for p in tree if not any(q != p and _parent(q) == p for q in tree)]
        if len(leaves) != 1:
            raise RuntimeError(f"cannot tell the {self.name} worker process apart: {tree}")
        self.worker, self.pids = leaves[0], set(tree)
        self.base_children_cpu = self.children_cpu()
        self.cpus: set[int] | None = None

    def pin(self, cpus: set[int]) -> None:
        """Run the worker on ``cpus`` only (the reference's and the candidate's share them: they
        take turns, and on a shared or virtual machine two cores can be loaded very differently)."""
        assert self.worker is not None
        os.sched_setaffinity(self.worker, cpus)
        self.cpus = set(cpus)

    def setup(self) -> None:
        reply = self.request({"op": "setup", "size": self.arena.size}, "setup", fds=[self.arena.fd])
        if reply.get("op") != "ok":
            raise RuntimeError(f"the {self.name} process refused its arena: {reply}")

    def grow(self, size: int) -> None:
        self.arena.resize(size)
        self.setup()
        self.layout = []  # its tensors lay over the old mapping

    def cpu_ns(self) -> int:
        """CPU time of the worker process, all its threads (the kernel's account, read from here)."""
        assert self.worker is not None
        try:
            self._cpu = time.clock_gettime_ns(((~self.worker) << 3) | 2)  # CPUCLOCK_SCHED of a process
        except OSError:
            pass  # gone: the channel says so next
        return self._cpu

    def children_cpu(self) -> int:
        """CPU ticks of the worker's reaped children (cutime + cstime in /proc/PID/stat)."""
        try:
            with open(f"/proc/{self.worker}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            return int(fields[13]) + int(fields[14])
        except (OSError, IndexError, ValueError):
            return 0

    def foreign(self, allowed_threads: int) -> str | None:
        """What the candidate started beyond what it was given (seen from outside, in /proc)."""
        assert self.session.pid is not None and self.worker is not None
        extra = set(process_tree(self.session.pid)) - self.pids
        if extra:
            return f"the candidate started {len(extra)} process(es)"
        if self.children_cpu() > self.base_children_cpu:
            return "the candidate ran work in child processes"
        if self.cpus is not None and os.sched_getaffinity(self.worker) != self.cpus:
            return "the candidate changed the CPUs it runs on"
        threads = task_count(self.worker)
        if threads > allowed_threads:
            return (f"the candidate runs {threads} threads; {allowed_threads} allowed (only the configured threads, "
                    "e.g. OpenMP with OMP_NUM_THREADS, may run a kernel)")
        return None

    def close(self) -> None:
        self.arena.close()


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _error(reply: dict[str, Any], n: int = 2000) -> tuple[str, str | None]:
    msg = str(reply.get("message", ""))[:n]
    tb = reply.get("traceback")
    return msg, (str(tb)[-3000:] if tb is not None else None)


def _read(arena: wire.Arena, value: Any) -> Any:
    """Copies of the tensors a parsed description points at."""
    if isinstance(value, (list, tuple)):
        return type(value)(_read(arena, v) for v in value)
    if isinstance(value, wire.TensorRef):
        dtype = _TORCH_DTYPES[value.dtype]
        n = value.nbytes
        if n == 0:
            return torch.empty(value.shape, dtype=dtype)
        buf = np.frombuffer(arena.view(value.offset or 0, n), dtype=np.uint8).copy()
        return torch.from_numpy(buf).view(dtype).view(value.shape)
    return value


def _aliases(value: Any) -> list[int | None]:
    return [leaf.alias_of if isinstance(leaf, wire.TensorRef) else None for leaf in wire.leaves_of(value)]


def _finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in wire.leaves_of(value)
               if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()))


@dataclass
class _Batch:
    """Calls run back to back in one request: their inputs, and what the parent keeps of a side's run."""

    kind: str
    variant: int
    n: int
    first_call: int
    fwd_seed: int
    pristine: bytes = b""
    descs: list[Any] = field(default_factory=list)
    picked: tuple[int, ...] = ()

    @property
    def where(self) -> str:
        last = self.first_call + self.n - 1
        return f"call {self.first_call}" + (f"-{last}" if self.n > 1 else "") + f" ({self.kind})"

    def one(self, i: int) -> str:
        return self.where if self.n == 1 else f"call {self.first_call + i} of {self.where}"


@dataclass
class _Run:
    times: tuple[CallTime, CallTime]  # (CPU, wall)
    outputs: list[Any]  # parsed descriptions, one per call
    values: dict[int, Any]  # the picked calls' outputs, read from the arena
    modified: bool


class _Conversation:
    """The whole evaluation, run in a thread (blocking socket I/O, the parent's own clocks)."""

    def __init__(self, req: JudgeRequest, gen: _Peer, ref: _Peer, cand: _Peer):
        self.req, self.gen, self.ref, self.cand = req, gen, ref, cand
        self.result: dict[str, Any] = {}
        seed = req.input_seed if req.input_seed is not None else secrets.randbits(_SEED_BITS)
        self.input_seed = seed
        self.rng = random.Random(seed)
        self.fwd_rng = random.Random(seed ^ 0x5EED)
        self.fwd_seeds: list[int] = []
        self.pick = random.Random(secrets.randbits(64))  # which outputs are compared: nothing the candidate sees
        self.gen_cap = 1 << 20
        self.in_cap = 1 << 20
        self.out_cap = 1 << 20
        self.overhead = 0  # the reference's CPU for a request that runs no forward (see _probe)
        self.allowed_threads = max(1, req.threads)
        self.calls = 0
        self.batches = 0
        self.batch = 1
        self.call_bytes = 1  # arena bytes of one call's inputs and of its reference outputs (size the batches)
        self.out_bytes = 1
        self.queue: list[tuple[bytes, list[Any]]] = []  # drawn inputs of upcoming batches
        self.pending: tuple[int, list[int], int, list[int]] | None = None  # a draw asked for, not yet taken
        self.busy_cpu = 0  # the candidate's CPU in its own turns ...
        self.idle_cpu = 0  # ... and outside them

    # arenas: the inputs process's holds what it draws; the two sides' are [inputs | outputs]
    in_off = 0

    @property
    def out_off(self) -> int:
        return self.in_cap

    def _grow(self) -> None:
        if self.gen.arena.size < self.gen_cap:
            self.gen.grow(self.gen_cap)
        for peer in (self.ref, self.cand):
            if peer.arena.size < self.in_cap + self.out_cap:
                peer.grow(self.in_cap + self.out_cap)

    def _fwd_seed(self, batch: int) -> int:
        while len(self.fwd_seeds) <= batch:
            self.fwd_seeds.append(self.fwd_rng.getrandbits(_SEED_BITS))
        return self.fwd_seeds[batch]

    # ------------------------------------------------------------ start
    def load(self) -> Any:
        req = self.req
        for peer in (self.gen, self.ref, self.cand):
            peer.hello()
        self._grow()
        for peer in (self.gen, self.ref, self.cand):
            peer.setup()
        # the two timed workers share the last CPUs and take turns; what works meanwhile (this
        # thread, the inputs process) stays on the others where there are others
        cpus = sorted(os.sched_getaffinity(0))
        timed = set(cpus[-max(1, min(req.threads, len(cpus))):])
        for peer in (self.ref, self.cand):
            peer.pin(timed)
        self.gen.pin(set(cpus) - timed or timed)
        os.sched_setaffinity(0, set(cpus) - timed or timed)
        reply = self.gen.request({"op": "load_inputs", "code": req.problem_code}, "loading the problem")
        if reply.get("op") != "loaded":
            msg, tb = _error(reply)
            raise Verdict("reference_error", f"the problem failed to load: {msg}", traceback_tail=tb)
        reply = self.ref.request({"op": "load_reference", "code": req.problem_code, "seed": req.seed,
                                  "device": req.device, "compile": req.compile_reference}, "loading the reference")
        if reply.get("op") != "loaded":
            msg, tb = _error(reply)
            raise Verdict("reference_error", f"the reference failed: {msg}", traceback_tail=tb)
        init = wire.parse_value(reply["init_inputs"], need_offsets=False)
        if any(isinstance(leaf, wire.Other) for leaf in wire.leaves_of(init)):
            raise Verdict("reference_error", "get_init_inputs() returned something other than numbers (not supported)")
        self.allowed_threads = max(self.allowed_threads, task_count(self.ref.worker or 0))
        reply = self.cand.request({"op": "load_candidate", "code": req.candidate_code, "seed": req.seed,
                                   "device": req.device, "init_inputs": list(init) if isinstance(init, (list, tuple))
                                   else [init], "extensions": req.extensions, "build_settings": req.build_settings},
                                  "loading the candidate")
        if reply.get("op") != "loaded":
            msg, tb = _error(reply)
            kind = reply.get("kind") if reply.get("op") == "error" else None
            if kind == "load":
                raise Verdict("load_error", msg, traceback_tail=tb)
            if kind == "init":
                raise Verdict("runtime_error", msg, traceback_tail=tb)
            raise Verdict("invalid_output", f"the candidate process answered {str(reply.get('op'))[:40]!r} to loading")
        self._check_candidate("after loading")
        self.cand.last_cpu = self.cand.cpu_ns()
        return init

    def _check_candidate(self, when: str) -> None:
        allowed = self.allowed_threads
        if self.req.device != "cpu":
            # as many threads as the reference's process runs now: it runs the same loop on the same
            # device, and CUDA starts its own threads at a process's first call, not at load
            allowed = max(allowed, task_count(self.ref.worker or 0))
        why = self.cand.foreign(allowed)
        if why is not None:
            raise Verdict("policy_violation", f"{why} ({when})")

    # ------------------------------------------------------------ inputs
    def _ask_draw(self, n: int, variants: list[int], batches: int) -> None:
        """Ask the inputs process for ``batches`` batches of ``n`` calls (call ``i`` of a batch in
        distribution ``variants[i]``); it works while the sides run (it is pinned away from their
        CPUs); :meth:`_take_draw` collects them."""
        seeds = [self.rng.getrandbits(_SEED_BITS) for _ in range(n * batches)]
        wire.send(self.gen.session.channel, {"op": "generate", "seeds": seeds, "variants": variants * batches,
                                             "offset": 0, "capacity": self.gen_cap})
        self.pending = (n, variants, batches, seeds)

    def _take_draw(self) -> None:
        assert self.pending is not None
        n, variants, batches, seeds = self.pending
        self.pending = None
        try:
            reply = wire.recv(self.gen.session.channel, deadline=self.gen.deadline)
        except (wire.ChannelClosed, ConnectionResetError):
            raise _PeerDied(self.gen, "drawing inputs") from None
        while reply.get("op") == "error" and reply.get("kind") == "arena":
            self.gen_cap = wire.align(max(int(reply["need"]) * 5 // 4, 2 * self.gen_cap))
            self._grow()
            reply = self.gen.request({"op": "generate", "seeds": seeds, "variants": variants * batches, "offset": 0,
                                      "capacity": self.gen_cap}, "drawing inputs")
        if reply.get("op") != "generated":
            msg, tb = _error(reply)
            raise Verdict("reference_error", f"get_inputs() failed: {msg}", traceback_tail=tb)
        descs, sizes = reply["inputs"], reply.get("sizes")
        if (not isinstance(descs, list) or len(descs) != len(seeds) or not isinstance(sizes, list)
                or len(sizes) != len(seeds) or not all(isinstance(x, int) and x >= 0 for x in sizes)
                or sum(sizes) > self.gen_cap):
            raise RuntimeError("the inputs process drew inputs that do not add up")
        for desc in descs:
            leaves = wire.leaves_of(wire.parse_value(desc, arena_size=self.gen_cap))
            if any(isinstance(leaf, wire.Other) for leaf in leaves):
                raise Verdict("reference_error", "get_inputs() returned something other than tensors and numbers")
        start = 0
        for k in range(batches):
            stop = start + sum(sizes[k * n:(k + 1) * n])
            self.queue.append((bytes(self.gen.arena.view(start, stop - start)),
                               [_shift(d, -start) for d in descs[k * n:(k + 1) * n]]))
            self.call_bytes = max(self.call_bytes, (stop - start) // n)
            start = stop

    def _next_batch(self, kind: str, variants: list[int], ahead: int = 1) -> _Batch:
        n = len(variants)
        if not self.queue:
            if self.pending is None:
                self._ask_draw(n, variants, ahead)
            self._take_draw()
        pristine, descs = self.queue.pop(0)
        if ahead > 1 and not self.queue and self.pending is None:
            self._ask_draw(n, variants, ahead)  # the next chunk, drawn while this batch runs
        if len(pristine) > self.in_cap:
            self.in_cap = wire.align(max(len(pristine) * 5 // 4, 2 * self.in_cap))
            self._grow()
        b = _Batch(kind, max(variants), n, self.calls + 1, self._fwd_seed(self.batches), pristine, descs)
        self.calls += n
        self.batches += 1
        return b

    # ------------------------------------------------------------ one batch on one side
    def _run(self, peer: _Peer, b: _Batch, next_seed: int, which: str = "eager") -> _Run:
        """Run batch ``b`` on one side; ``next_seed`` seeds it for its next run. The side's CPU
        clock is read before its inputs are written and after the parent holds its outputs, so
        any work it does on them, early or late, is in ``go`` or ``collect``."""
        where = b.where
        relayout = peer.layout[:b.n] != b.descs
        if relayout or peer.seeded != b.fwd_seed:  # seed (and tensors over the slots) before the inputs exist
            reply = peer.request({"op": "prepare", "seed": b.fwd_seed, "calls": b.descs if relayout else None}, where)
            self._expect(peer, reply, "ok", where)
            if relayout:
                peer.layout = list(b.descs)
        c0 = peer.cpu_ns()
        if not peer.trusted:
            self.idle_cpu += max(0, c0 - peer.last_cpu)
        view = peer.arena.view(self.in_off, len(b.pristine))
        view[:] = b.pristine
        del view
        t0 = time.perf_counter_ns()
        reply = peer.request({"op": "go", "n": b.n, "which": which}, where)
        t1, c1 = time.perf_counter_ns(), peer.cpu_ns()
        if reply.get("op") == "error" and reply.get("kind") == "forward":
            msg, tb = _error(reply)
            if peer.trusted:
                raise Verdict("reference_error", f"the reference failed: {msg}", traceback_tail=tb)
            raise Verdict("runtime_error", f"{where}: {msg}", traceback_tail=tb)
        self._expect(peer, reply, "done", where)
        while True:
            reply = peer.request({"op": "collect", "offset": self.out_off, "capacity": self.out_cap,
                                  "next_seed": next_seed}, where)
            t2 = time.perf_counter_ns()
            if reply.get("op") == "error" and reply.get("kind") == "arena":
                need = int(reply.get("need", 0))
                if not peer.trusted and need > 8 * self.out_cap + (16 << 20):
                    raise Verdict("shape_mismatch", f"{where}: the outputs take {need} bytes, far more than the "
                                                    "reference's")
                self.out_cap = wire.align(max(need * 5 // 4, 2 * self.out_cap))
                self._grow()
                continue
            break
        self._expect(peer, reply, "collected", where)
        peer.seeded = next_seed
        if peer.trusted and isinstance(reply.get("bytes"), int):
            self.out_bytes = max(self.out_bytes, reply["bytes"] // max(1, b.n))
        try:
            outs = reply.get("outputs")
            if not isinstance(outs, list) or len(outs) != b.n:
                raise wire.ProtocolError(f"{len(outs) if isinstance(outs, list) else 'no'} outputs for {b.n} calls")
            parsed = [wire.parse_value(o, arena_size=peer.arena.size) for o in outs]
            values = {i: _read(peer.arena, parsed[i]) for i in b.picked}
        except wire.ProtocolError as exc:
            if peer.trusted:
                raise
            raise Verdict("invalid_output", f"{where}: the candidate's outputs: {exc}") from None
        now = np.frombuffer(peer.arena.view(self.in_off, len(b.pristine)), dtype=np.uint8)
        modified = not np.array_equal(now, np.frombuffer(b.pristine, dtype=np.uint8))
        del now
        c2 = peer.cpu_ns()
        peer.last_cpu = c2
        if not peer.trusted:
            self.busy_cpu += c2 - c0
            self._check_candidate(f"after {where}")
        return _Run((CallTime(c1 - c0, c2 - c1), CallTime(t1 - t0, t2 - t1)), parsed, values, modified)

    def _expect(self, peer: _Peer, reply: dict[str, Any], op: str, where: str) -> None:
        if reply.get("op") == op:
            return
        msg, tb = _error(reply)
        if peer.trusted:
            raise Verdict("reference_error", f"the reference failed ({where}): {msg}", traceback_tail=tb)
        raise Verdict("invalid_output", f"{where}: the candidate process answered {str(reply.get('op'))[:40]!r} "
                                        f"instead of {op!r}" + (f": {msg}" if msg else ""))

    # ------------------------------------------------------------ one batch, both sides, judged
    def batch_call(self, kind: str, variants: list[int], cand_first: bool, compare_all: bool,
                   ahead: int = 1) -> dict[str, tuple[CallTime, CallTime]]:
        """One call per entry of ``variants`` (its input distribution), each on fresh inputs, both
        sides, judged: every output's structure, shape and dtype, and the values of all of them
        (``compare_all``) or of two picked at random by a generator the candidate never observes.
        Returns the batch's (CPU, wall) times per side."""
        n = len(variants)
        b = self._next_batch(kind, variants, ahead)
        b.picked = tuple(range(n)) if compare_all or n <= 2 else tuple(sorted(self.pick.sample(range(n), 2)))
        nxt = self._fwd_seed(self.batches)
        runs: dict[str, _Run] = {}
        for peer in ([self.cand, self.ref] if cand_first else [self.ref, self.cand]):
            compiled = peer is self.ref and self.req.compile_reference and kind == "timed"
            runs[peer.name] = self._run(peer, b, b.fwd_seed if compiled else nxt)
            if peer is self.ref and b.variant != 0 and not cand_first and not all(_finite(v) for v in
                                                                                   runs["reference"].values.values()):
                self.queue.clear()  # these distributions break the problem: its own inputs instead
                self.calls -= n
                return self.batch_call(kind, [0] * n, cand_first, compare_all)
            if compiled:
                runs["reference_compiled"] = self._run(self.ref, b, nxt, "compiled")
        ref, cand = runs["reference"], runs["candidate"]
        if cand.modified and not ref.modified:
            raise Verdict("incorrect", f"{b.where}: the candidate modified its inputs in place")
        for i, (c, r) in enumerate(zip(cand.outputs, ref.outputs)):
            if any(isinstance(leaf, wire.Other) for leaf in wire.leaves_of(r)):
                raise Verdict("reference_error", "the reference returned something that is not a tensor or a number")
            check_layout(c, r, _aliases(c), _aliases(r), where=b.one(i))
        for i in b.picked:
            diffs = compare(cand.values[i], ref.values[i], _aliases(cand.outputs[i]), _aliases(ref.outputs[i]),
                            atol=self.req.atol, rtol=self.req.rtol, where=b.one(i))
            for key, v in diffs.items():
                self.result[key] = max(self.result.get(key, 0.0), v)
        return {name: run.times for name, run in runs.items()}

    # ------------------------------------------------------------ the plan
    def run(self) -> dict[str, Any]:
        affinity = os.sched_getaffinity(0)  # this thread's (a pool thread: given back as it was)
        try:
            return self._run_plan()
        finally:
            os.sched_setaffinity(0, affinity)

    def _run_plan(self) -> dict[str, Any]:
        req = self.req
        self.load()
        if req.timing:
            # warm-up calls (they pay the one-off costs: page faults, lazy initialisation) size the
            # timed batches; a request's own cost is measured on the reference
            warm = max(1, req.warmup)
            go = self.batch_call("warm-up", [0] * warm, False, True)["reference"][0].go
            self.overhead = self._probe()
            self.batch = self._batch_size(max(1, go - self.overhead) / warm)
            if self.batch > warm:  # touch every slot once before timing, and measure again
                go = self.batch_call("warm-up", [0] * self.batch, False, False)["reference"][0].go
                self.batch = self._batch_size(max(1, go - self.overhead) / self.batch)
        if req.trials:  # KernelBench's correctness trials, in three distributions, compared in full
            self.batch_call(f"{req.trials} trials", [t % 3 for t in range(req.trials)], False, True)
        timed: list[dict[str, tuple[CallTime, CallTime]]] = []
        if req.timing:
            ahead = max(1, min(8, GEN_CHUNK_BYTES // max(1, self.call_bytes * self.batch)))
            for _ in range(2 if req.retime else 1):
                for i in range(req.iters):
                    timed.append(self.batch_call("timed", [0] * self.batch, i % 2 == 1, False, ahead))
                if self.pending is not None:
                    self._take_draw()
                self.queue.clear()
                self._timings(timed)
                # again only when twice the samples (a sqrt(2) narrower interval) can make it
                if not self.result["timing_unstable"] or self.result["speedup_hw"] > RETIME_REACH * req.max_uncertainty:
                    break
        self.batch_call("final check", [1], True, True)
        self._check_idle()
        # last, so that its extra work does not make the reference's process differ from the
        # candidate's while they are timed
        reply = self.ref.request({"op": "selfcheck"}, "checking the reference")
        self.result["reference_nondeterministic"] = not bool(reply.get("deterministic", True))
        if req.profile:
            self.result["profile"] = {name: self._profile(peer) for name, peer in
                                      (("candidate", self.cand), ("reference", self.ref))}
        self.result["calls_checked"] = self.calls
        self.result["calls_per_timing"] = self.batch
        self.result["input_seed"] = self.input_seed
        return self.result

    def _probe(self, n: int = 3) -> int:
        """The reference process's CPU for a ``go`` that runs no forward (receiving the request,
        answering it): the same loop serves both sides, so the median is taken off every batch
        of both. Only the reference's own is used: a candidate cannot inflate what is deducted."""
        costs = []
        for _ in range(n):
            c0 = self.ref.cpu_ns()
            self._expect(self.ref, self.ref.request({"op": "go", "n": 0}, "measuring a request"), "done", "probe")
            costs.append(self.ref.cpu_ns() - c0)
        return sorted(costs)[n // 2]

    def _check_idle(self) -> None:
        """CPU the candidate spent while it was not its turn: an honest one waits for its next
        request; one that works then could slow the reference down or prepare its answers."""
        idle_ms, busy_ms = self.idle_cpu / 1e6, self.busy_cpu / 1e6
        if idle_ms > IDLE_CPU_MS + IDLE_CPU_SHARE * busy_ms:
            raise Verdict("policy_violation", f"the candidate used {idle_ms:.1f} ms of CPU while it was not its "
                                              f"turn (it used {busy_ms:.1f} ms in its turns)")

    def _batch_size(self, per_call_ns: float) -> int:
        """Calls per timed batch: enough for ``batch_ms`` of the reference's work (the parent's
        request round trips then weigh little), at most ``MAX_BATCH`` and what fits in memory."""
        n = int(self.req.batch_ms * 1e6 // max(per_call_ns, 1000.0)) or 1
        return max(1, min(n, MAX_BATCH, MAX_BATCH_BYTES // (self.call_bytes + self.out_bytes)))

    def _timings(self, timed: list[dict[str, tuple[CallTime, CallTime]]]) -> None:
        """Per-call statistics (a batch's time, less the cost of a request by itself, over its
        calls) on the credited clock: the worker's CPU time with one thread (what the forward
        cost, not how long it waited for a core on a busy machine), wall time with more (parallel
        kernels are credited for their parallelism)."""
        clock = 0 if self.req.threads == 1 else 1
        timings, per_call = {}, {}
        for name in timed[0]:
            side = {}
            for c, label in ((clock, "credited"), (1 - clock, "other")):
                ref_calls = [t["reference"][c] for t in timed]
                # the request's own cost comes off, but never more than half the reference's batch
                # (a noisy estimate must not turn small batches into nothing), and never a batch
                # below a tenth of what was measured
                fixed = min(self.overhead, sorted(r.go for r in ref_calls)[len(ref_calls) // 2] // 2) if c == 0 else 0
                ns = [max(x - fixed, x // 10, 1) // self.batch
                      for x in credited([t[name][c] for t in timed], ref_calls)]
                side[label] = stats(ns)
                if label == "credited":
                    per_call[name] = ns
            timings[name] = {**side["credited"], ("wall_median" if clock == 0 else "cpu_median"): side["other"]["median"]}
        speed, speed_mean = speedups(timings["reference"], timings["candidate"])
        lo, hi, hw = speedup_interval(speed, per_call["reference"], per_call["candidate"])
        noisy = hw > self.req.max_uncertainty
        self.result.update(timings=timings, timing_clock="cpu" if clock == 0 else "wall", speedup=speed,
                           speedup_mean=speed_mean, speedup_ci=[lo, hi], speedup_hw=hw,
                           timing_unstable=noisy,
                           timing_note=(f"the speedup's 90% interval [{lo:.3g}, {hi:.3g}] is wider than "
                                        f"+/-{self.req.max_uncertainty:.0%} (a busy machine): not credited"
                                        if noisy else None))
        if "reference_compiled" in timings:
            self.result["speedup_vs_compiled"] = speedups(timings["reference_compiled"], timings["candidate"])[0]

    def _profile(self, peer: _Peer) -> list[dict[str, Any]]:
        reply = peer.request({"op": "profile"}, "profiling")
        rows = reply.get("rows") if reply.get("op") == "profiled" else None
        if not isinstance(rows, list):
            return []
        out = []
        for row in rows[:10]:
            if isinstance(row, dict):
                out.append({"op": str(row.get("op"))[:200], **{k: float(row[k]) for k in
                            ("calls", "self_cpu_ms", "cpu_total_ms") if isinstance(row.get(k), (int, float))}})
        return out


def _shift(desc: Any, delta: int) -> Any:
    """A description with every tensor offset moved by ``delta`` (generated → input region)."""
    if isinstance(desc, dict):
        out = {k: _shift(v, delta) for k, v in desc.items()}
        if desc.get("t") == "tensor":
            out["offset"] = int(desc["offset"]) + delta
        return out
    if isinstance(desc, list):
        return [_shift(v, delta) for v in desc]
    return desc


def _death(res: SandboxResult, who: str, during: str) -> Verdict:
    if who != "candidate":
        return Verdict("reference_error", f"the {who} process ended during {during}: {res.status} "
                                          f"{res.error_message or ''}".strip(), traceback_tail=res.stderr[-2000:] or None)
    if res.status == "timeout" or (res.status == "killed" and "CPU time" in (res.error_message or "")):
        return Verdict("timeout", f"timed out during {during}: {res.error_message}")
    detail = {"crashed": "the process crashed", "killed": "the process was killed", "memory_exceeded":
              "memory limit exceeded", "error": "the process failed", "ok": "the process exited"}.get(res.status, res.status)
    return Verdict("runtime_error", f"{detail} during {during}: {res.error_message or ''}".strip(),
                   traceback_tail=res.traceback_tail or (res.stderr[-2000:] if res.stderr else None))


async def judge(req: JudgeRequest, limits: SandboxLimits, *, fork_server: bool = True) -> tuple[dict[str, Any],
                                                                                               dict[str, Any]]:
    """Evaluate one candidate; returns (result fields, sandbox info). Candidate failures are
    statuses in the result; an exception means the harness itself failed."""
    preload = [SERVE_MODULE] if fork_server else None
    async with open_sandboxed(SERVE, "inputs", req.threads, limits=limits, preload=preload) as gen_s, \
            open_sandboxed(SERVE, "reference", req.threads, limits=limits, preload=preload) as ref_s, \
            open_sandboxed(SERVE, "candidate", req.threads, limits=limits, preload=preload) as cand_s:
        deadline = time.monotonic() + limits.wall_s + 30
        gen, ref, cand = (_Peer("inputs", gen_s, deadline), _Peer("reference", ref_s, deadline),
                          _Peer("candidate", cand_s, deadline))
        conv = _Conversation(req, gen, ref, cand)
        try:
            result = await asyncio.to_thread(conv.run)
            result.setdefault("status", "correct")
        except Verdict as v:
            result = {**conv.result, "status": v.status, "message": v.message, **v.extra}
        except _PeerDied as died:
            session = died.peer.session
            try:
                res = await asyncio.wait_for(asyncio.shield(session.result()), 2.0)
            except asyncio.TimeoutError:  # it closed the channel but lives on: end it
                res = await session.close()
            death = _death(res, died.peer.name, died.during)
            result = {**conv.result, "status": death.status, "message": death.message, **death.extra}
        finally:
            for peer in (gen, ref, cand):
                peer.close()
        # an honest process returns when its channel closes (and its CPU is accounted to the fork
        # server like any finished sandbox's); one that does not is killed
        _, _, cand_res = await asyncio.gather(gen_s.close(CLOSE_GRACE_S), ref_s.close(CLOSE_GRACE_S),
                                              cand_s.close(CLOSE_GRACE_S))
    info = {"status": cand_res.status, "wall_s": round(cand_res.wall_s, 3), "cpu_s": cand_res.cpu_s,
            "max_rss_mb": cand_res.max_rss_mb, "signal": cand_res.signal, "enforced": cand_res.enforced,
            "notes": cand_res.notes, "calls_checked": conv.calls}
    result.setdefault("input_seed", conv.input_seed)
    return result, info
