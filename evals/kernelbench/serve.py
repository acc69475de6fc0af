"""The sandboxed side of a KernelBench evaluation: one process per role, driven by the judge.

``serve(role, channel_fd=...)`` is a :func:`closedloop.sandbox.open_sandboxed` target. The
*inputs* process loads the problem file and draws every call's inputs (``get_inputs``). The
*reference* process loads the problem file too (``Model``, ``get_init_inputs``), computes the
reference outputs and is timed; neither ever receives candidate code. The *candidate* process
loads only the candidate (``ModelNew``) and runs it on inputs it is given. The reference and the
candidate processes do exactly the same work between their forwards (so neither comes to its
turn with warmer caches). Neither judges anything: each answers requests and returns outputs through the arena (see
``wire.py``); comparison, timing and the verdict are made by the parent (``judge.py``).

Everything in the candidate process, this loop included, is under the candidate's control once
its code has run: the parent treats every answer from it as untrusted data.

Requests (``op``): ``setup`` (map the arena; the memfd travels with it), ``load_inputs`` /
``load_reference`` / ``load_candidate``, ``generate`` (inputs: draw inputs, one set per call,
into the arena), ``prepare`` (seed torch; make tensors over the arena's input slots when the
layout changes: the parent rewrites their values for every batch), ``go`` (the forwards of a
batch: the only timed step), ``collect`` (write the outputs into the arena), ``selfcheck``
(reference: is it deterministic), ``profile``.
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import cpp_extension  # imported here, by the fork server, once (it pulls in setuptools)

from closedloop.evals.kernelbench import wire
from closedloop.evals.kernelbench.buildcache import ExtensionSpec, MAX_SPECS, extension_key, spec_from_call

_TORCH_DTYPES = {name: getattr(torch, name) for name in wire.DTYPES}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def _tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _seed(seed: int) -> None:
    """``torch.manual_seed`` for CPU tensors (its other backends cost ~200 us per call) and numpy."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    np.random.seed(seed % (2 ** 32))


def exec_module(name: str, code: str, filename: str) -> types.ModuleType:
    """Import source as a real module from a file (Triton's JIT needs source files)."""
    path = Path(os.getcwd()) / filename
    path.write_text(code)
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    sys.modules[name] = mod
    exec(compile(code, str(path), "exec"), mod.__dict__)
    return mod


def vary(inputs: list[Any], variant: int, seed: int) -> list[Any]:
    """Same shapes and dtypes as ``get_inputs`` gives, another distribution (floating tensors
    only): variant 1 is N(0, 4), variant 2 uniform on [0.1, 10.1]."""
    if variant == 0:
        return inputs
    g = torch.Generator().manual_seed(seed + 7919 * variant)
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            if variant % 2 == 1:
                y = torch.randn(x.shape, generator=g, dtype=torch.float32) * 2.0
            else:
                y = torch.rand(x.shape, generator=g, dtype=torch.float32) * 10.0 + 0.1
            out.append(y.to(x.dtype))
        else:
            out.append(x)
    return out


class ArenaFull(Exception):
    def __init__(self, need: int):
        super().__init__(f"the arena needs {need} bytes")
        self.need = need


class _Server:
    def __init__(self, role: str):
        self.role = role
        self.mm: mmap.mmap | None = None
        self.model: Any = None
        self.compiled: Any = None
        self.module: types.ModuleType | None = None
        self.device = "cpu"
        self.slots: list[list[Any]] = []
        self.outs: list[Any] = []
        self.fwd_seed = 0

    # ---------------------------------------------------------------- arena
    def setup(self, msg: dict, fds: list[int]) -> dict:
        if not fds:
            raise ValueError("setup without an arena")
        if self.mm is not None:
            self.mm.close()
        self.mm = mmap.mmap(fds[0], int(msg["size"]))
        os.close(fds[0])
        for fd in fds[1:]:
            os.close(fd)
        return {"op": "ok"}

    def _write(self, value: Any, base: int, limit: int) -> tuple[Any, int]:
        """Write ``value``'s tensors contiguously into the arena from ``base``; its description."""
        assert self.mm is not None
        pos = base

        def walk(node: Any, depth: int) -> Any:
            nonlocal pos
            if isinstance(node, (list, tuple)) and depth < wire.MAX_VALUE_DEPTH:
                return {"t": "list" if isinstance(node, list) else "tuple", "items": [walk(x, depth + 1) for x in node]}
            if isinstance(node, torch.Tensor):
                t = node.detach()
                name = _DTYPE_NAMES.get(t.dtype)
                if name is None:
                    return {"t": "other", "type": f"tensor of dtype {t.dtype}"}
                t = t.cpu().contiguous()
                n = t.numel() * t.element_size()
                if pos + n > limit:
                    raise ArenaFull(pos + n - base)
                if n:
                    dst = torch.frombuffer(self.mm, dtype=torch.uint8, count=n, offset=pos)
                    dst.copy_(t.view(-1).view(torch.uint8))
                desc = {"t": "tensor", "dtype": name, "shape": list(t.shape), "offset": pos}
                pos = wire.align(pos + n)
                return desc
            if node is None or isinstance(node, (bool, int, float)):
                return {"t": "scalar", "v": node}
            return {"t": "other", "type": type(node).__name__}

        return walk(value, 0), pos - base

    def _read(self, desc: Any) -> Any:
        """Tensors over the arena (no copy) for a description the parent wrote."""
        assert self.mm is not None

        def walk(node: Any) -> Any:
            if isinstance(node, (list, tuple)):
                return type(node)(walk(x) for x in node)
            if isinstance(node, wire.TensorRef):
                dtype = _TORCH_DTYPES[node.dtype]
                numel = 1
                for d in node.shape:
                    numel *= d
                if numel == 0:
                    return torch.empty(node.shape, dtype=dtype)
                if node.offset is None:  # parse_value(need_offsets=True) refuses these; kept explicit
                    raise wire.ProtocolError("a tensor description without an arena offset")
                return torch.frombuffer(self.mm, dtype=dtype, count=numel, offset=node.offset).view(node.shape)
            return node

        return walk(wire.parse_value(desc, arena_size=len(self.mm)))

    # ---------------------------------------------------------------- loading
    def load_inputs(self, msg: dict, fds: list[int]) -> dict:
        """The problem's module only (its ``get_inputs``): this process draws inputs, nothing else."""
        self.module = exec_module("kb_problem", msg["code"], "problem.py")
        return {"op": "loaded"}

    def load_reference(self, msg: dict, fds: list[int]) -> dict:
        self.device = msg.get("device", "cpu")
        self.module = mod = exec_module("kb_reference", msg["code"], "reference.py")
        _seed(int(msg["seed"]))
        init = list(mod.get_init_inputs())
        _seed(int(msg["seed"]))
        self.model = mod.Model(*init)
        if self.device != "cpu":
            self.model = self.model.to(self.device)
        if msg.get("compile"):
            import torch._inductor.config as inductor_config

            inductor_config.compile_threads = 1
            self.compiled = torch.compile(self.model)
        init_desc, _ = self._describe(init)
        return {"op": "loaded", "init_inputs": init_desc}

    def load_candidate(self, msg: dict, fds: list[int]) -> dict:
        self.device = msg.get("device", "cpu")
        _install_prebuilt(msg.get("extensions", {}), msg.get("build_settings", {}))
        try:
            self.module = mod = exec_module("kb_candidate", msg["code"], "candidate.py")
        except BaseException as exc:  # noqa: BLE001
            return {"op": "error", "kind": "load", "message": f"loading the candidate raised {type(exc).__name__}: "
                                                              f"{str(exc)[:2000]}",
                    "traceback": _tail(traceback.format_exc())}
        if not hasattr(mod, "ModelNew"):
            return {"op": "error", "kind": "load", "message": "the candidate defines no ModelNew class"}
        init = msg.get("init_inputs", [])
        try:
            _seed(int(msg["seed"]))
            self.model = mod.ModelNew(*init)
            if self.device != "cpu" and isinstance(self.model, torch.nn.Module):
                self.model = self.model.to(self.device)
        except Exception as exc:  # noqa: BLE001
            return {"op": "error", "kind": "init", "message": f"ModelNew(*get_init_inputs()) raised "
                                                              f"{type(exc).__name__}: {str(exc)[:2000]}",
                    "traceback": _tail(traceback.format_exc())}
        return {"op": "loaded"}

    def _describe(self, value: Any) -> tuple[Any, int]:
        """A description without offsets (scalars and shapes only; used for init inputs)."""
        def walk(node: Any, depth: int) -> Any:
            if isinstance(node, (list, tuple)) and depth < wire.MAX_VALUE_DEPTH:
                return {"t": "list" if isinstance(node, list) else "tuple", "items": [walk(x, depth + 1) for x in node]}
            if node is None or isinstance(node, (bool, int, float)):
                return {"t": "scalar", "v": node}
            return {"t": "other", "type": type(node).__name__}
        return walk(value, 0), 0

    # ---------------------------------------------------------------- calls
    def generate(self, msg: dict, fds: list[int]) -> dict:
        """Draw one call's inputs per seed (``get_inputs`` under that seed, then ``vary`` with that
        call's variant) and write them one after another into the arena."""
        assert self.module is not None and self.mm is not None
        base = int(msg["offset"])
        limit, pos, descs, sizes = base + int(msg["capacity"]), base, [], []
        for seed, variant in zip(msg["seeds"], msg["variants"]):
            _seed(int(seed))
            inputs = vary(list(self.module.get_inputs()), int(variant), int(seed))
            try:
                desc, used = self._write(inputs, pos, limit)
            except ArenaFull as full:
                return {"op": "error", "kind": "arena", "need": pos - base + full.need}
            descs.append(desc)
            sizes.append(used)
            pos += used
        return {"op": "generated", "inputs": descs, "sizes": sizes, "bytes": pos - base}

    def prepare(self, msg: dict, fds: list[int]) -> dict:
        """Seed torch for the next batch and, when given a layout, make tensors over the arena's
        input slots, one set per call (kept: each batch the parent writes new values into the same
        slots while this process is stopped, after this step)."""
        if msg.get("calls") is not None:
            self.slots = [list(self._read(desc)) for desc in msg["calls"]]
        self.fwd_seed = int(msg["seed"])
        _seed(self.fwd_seed)
        return {"op": "ok"}

    def _on_device(self, args: list[Any]) -> list[Any]:
        """A call's inputs (tensors over the arena, on the CPU) on the model's device."""
        if self.device == "cpu":
            return args
        return [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args]

    def go(self, msg: dict, fds: list[int]) -> dict:
        """The forwards of the first ``n`` slots, back to back: the only step the judge credits
        (``n`` = 0 measures what a request costs by itself)."""
        fn = self.compiled if msg.get("which") == "compiled" and self.compiled is not None else self.model
        n = int(msg["n"])
        outs = []
        try:
            with torch.no_grad():
                for args in self.slots[:n]:
                    outs.append(fn(*self._on_device(args)))
            if self.device == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            return {"op": "error", "kind": "forward", "message": f"forward raised {type(exc).__name__}: {str(exc)[:2000]}",
                    "traceback": _tail(traceback.format_exc())}
        self.outs = outs
        return {"op": "done"}

    def collect(self, msg: dict, fds: list[int]) -> dict:
        """Write every call's outputs into the arena, one after another; then seed torch for the
        next batch."""
        base = int(msg["offset"])
        limit, pos, descs = base + int(msg["capacity"]), base, []
        for args, out in zip(self.slots, self.outs):
            try:
                desc, used = self._write(out, pos, limit)
            except ArenaFull as full:
                return {"op": "error", "kind": "arena", "need": pos - base + full.need}
            # a hint for the candidate's author: which outputs are its inputs themselves
            in_ptrs = {a.untyped_storage().data_ptr(): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
            flat = out if isinstance(out, (list, tuple)) else [out]
            items = desc["items"] if desc.get("t") in ("list", "tuple") else [desc]
            for d, o in zip(items, flat):
                if isinstance(o, torch.Tensor) and d.get("t") == "tensor" and o.numel() > 0:
                    alias = in_ptrs.get(o.untyped_storage().data_ptr())
                    if alias is not None:
                        d["alias_of"] = alias
            descs.append(desc)
            pos += used
        self.outs = []
        if msg.get("next_seed") is not None:  # for the next batch, before its inputs exist
            self.fwd_seed = int(msg["next_seed"])
            _seed(self.fwd_seed)
        return {"op": "collected", "outputs": descs, "bytes": pos - base}

    def selfcheck(self, msg: dict, fds: list[int]) -> dict:
        """Run the first slot's inputs twice more with the same seed: equal outputs or not."""
        outs = []
        for _ in range(2):
            _seed(self.fwd_seed)
            with torch.no_grad():
                outs.append(self.model(*self._on_device([a.clone() if isinstance(a, torch.Tensor) else a
                                                         for a in self.slots[0]])))
        a, b = (o if isinstance(o, (list, tuple)) else [o] for o in outs)
        same = all(torch.equal(x, y) for x, y in zip(a, b) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor))
        return {"op": "selfcheck", "deterministic": bool(same)}

    def profile(self, msg: dict, fds: list[int]) -> dict:
        from torch.profiler import ProfilerActivity, profile

        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                self.model(*self._on_device([a.clone() if isinstance(a, torch.Tensor) else a for a in self.slots[0]]))
        rows = []
        for ev in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]:
            rows.append({"op": str(ev.key)[:200], "calls": int(ev.count), "self_cpu_ms": ev.self_cpu_time_total / 1e3 / 3,
                         "cpu_total_ms": ev.cpu_time_total / 1e3 / 3})
        return {"op": "profiled", "rows": rows}


_RUN = {"prepare": _Server.prepare, "go": _Server.go, "collect": _Server.collect, "profile": _Server.profile}
_ROLES = {"inputs": {"setup": _Server.setup, "load_inputs": _Server.load_inputs, "generate": _Server.generate},
          "reference": {"setup": _Server.setup, "load_reference": _Server.load_reference, "selfcheck": _Server.selfcheck,
                        **_RUN},
          "candidate": {"setup": _Server.setup, "load_candidate": _Server.load_candidate, **_RUN}}


def serve(role: str, threads: int = 1, *, channel_fd: int) -> dict[str, Any]:
    """Answer the judge's requests on ``channel_fd`` until it closes the channel."""
    if role not in _ROLES:
        raise ValueError(f"unknown role {role!r}")
    torch.set_num_threads(int(threads))
    chan = socket.socket(fileno=channel_fd)
    server = _Server(role)
    handlers = _ROLES[role]
    wire.send(chan, {"op": "hello"})
    calls = 0
    while True:
        fds: list[int] = []
        try:
            msg = wire.recv(chan, fds=fds)
        except wire.ChannelClosed:
            return {"requests": calls}
        calls += 1
        handler = handlers.get(msg["op"])
        if handler is None:
            reply: dict[str, Any] = {"op": "error", "kind": "protocol", "message": f"no such request: {msg['op']}"}
        else:
            try:
                reply = handler(server, msg, fds)
            except Exception as exc:  # noqa: BLE001 - the problem's own code failed (or a bad request)
                reply = {"op": "error", "kind": "internal", "message": f"{type(exc).__name__}: {str(exc)[:2000]}",
                         "traceback": _tail(traceback.format_exc())}
        wire.send(chan, reply)


# ---------------------------------------------------------------- extensions
def _install_prebuilt(extensions: dict[str, str], settings: dict[str, str]) -> None:
    """``load_inline`` in the candidate process loads what the trusted builder built for the very
    same call (by key) and builds nothing: an extension whose sources or options changed since
    the build step (they depend on something at run time) is refused."""
    original = cpp_extension.load_inline

    def load_inline(*args: Any, **kwargs: Any) -> Any:
        spec = spec_from_call(original, args, kwargs)
        key = extension_key(spec, settings)
        path = extensions.get(key)
        if path is None:
            raise RuntimeError(f"extension {spec.name!r} was not built by the build step: its sources or options "
                               "differ from what the candidate gave when it was built (they must not depend on run-time "
                               "values)")
        if spec.options.get("is_python_module", True) is False:
            torch.ops.load_library(path)
            return path
        import importlib.util

        mod_spec = importlib.util.spec_from_file_location(spec.name, path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        return module

    cpp_extension.load_inline = load_inline


class _NotBuilt:
    """What ``load_inline`` returns while the build step only records specs."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        def unavailable(*a: Any, **k: Any) -> Any:
            raise RuntimeError(f"extension {self._name}.{attr} is not available while the build step reads the "
                               "candidate (call it from forward, not at import)")
        return unavailable


def extract_specs(code: str) -> dict[str, Any]:
    """Sandbox target of the build step: run the candidate's module with a ``load_inline`` that
    only records its arguments. Returns the specs (the parent validates them) and, if the module
    failed, why."""
    original = cpp_extension.load_inline
    specs: list[dict[str, Any]] = []

    def record(*args: Any, **kwargs: Any) -> Any:
        spec = spec_from_call(original, args, kwargs)
        if len(specs) < MAX_SPECS:
            specs.append(spec.model_dump(mode="json"))
        return _NotBuilt(spec.name)

    cpp_extension.load_inline = record
    error = None
    t0 = time.perf_counter()
    try:
        exec_module("kb_candidate", code, "candidate.py")
    except BaseException as exc:  # noqa: BLE001
        error = {"message": f"loading the candidate raised {type(exc).__name__}: {str(exc)[:2000]}",
                 "traceback": _tail(traceback.format_exc())}
    return {"specs": specs, "error": error, "load_s": time.perf_counter() - t0}


__all__ = ["serve", "extract_specs", "vary", "ExtensionSpec"]
