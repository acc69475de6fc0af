"""Static policy for candidates: an AST check run before any candidate code executes.

Why AST and not regexes (KernelBench's checker): names in strings, comments or aliases
(``import threading as t``) fool a regex; the AST sees what the code does. This is a first
line only; runtime guards in ``worker.py`` catch what the AST cannot (dynamic attribute tricks).

Modes: ``strict`` also forbids torch compute ops (``torch.*``, ``F.*``, ``nn`` compute modules,
``@``) inside ``ModelNew.forward`` and ATen compute calls inside the C++; ``lenient`` reports
those as warnings.
"""

from __future__ import annotations

import ast
import re
from typing import Literal

from pydantic import BaseModel, Field

Mode = Literal["strict", "lenient"]

FORBIDDEN_MODULES = {"threading", "multiprocessing", "concurrent", "subprocess", "socket", "signal", "gc",
                     "inspect", "ctypes", "asyncio", "_thread", "pty", "shutil", "urllib", "http", "requests",
                     "importlib", "builtins", "pickle", "marshal", "resource", "sys", "os", "pathlib", "tempfile",
                     "io", "traceback", "weakref", "time", "timeit", "cProfile", "profile"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "globals", "vars", "locals", "setattr", "delattr",
                   "getattr", "open", "breakpoint", "input"}
FORBIDDEN_ATTRS = {"_getframe", "f_back", "f_globals", "f_locals", "__globals__", "__subclasses__", "__code__",
                   "__builtins__", "_make_subclass", "fork", "system", "popen", "spawn", "register_forward_hook",
                   "register_forward_pre_hook", "synchronize", "__class__", "__bases__", "__mro__",
                   "set_num_threads", "set_flush_denormal", "allow_tf32", "get_objects", "get_referrers"}
PATCHABLE_ROOTS = {"torch", "time", "F", "nn", "np", "numpy", "math", "triton", "tl", "cpp_extension"}
ALLOWED_TORCH_IN_FORWARD = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "tensor", "as_tensor",
                            "no_grad", "device", "Size", "float32", "float16", "bfloat16", "int64", "int32",
                            "bool", "is_tensor"}
CPP_CHEATS = [(re.compile(r"\bstd::(thread|async|jthread)\b|pthread_create|\bfork\s*\(|\bsystem\s*\(|\bpopen\s*\("),
               "threads or processes in C++ (OpenMP is allowed)")]
ATEN_COMPUTE = re.compile(r"\b(at|torch)::(?!empty|empty_like|zeros|zeros_like|Tensor|TensorOptions|kFloat|kDouble|"
                          r"kHalf|kBFloat16|kInt|kLong|kBool|ScalarType|Device|IntArrayRef|indexing|Scalar)"
                          r"[A-Za-z_]+\s*\(")
ATEN_METHODS = re.compile(r"\.\s*(matmul|mm|bmm|addmm|conv\d?d?|relu|softmax|log_softmax|sum|mean|exp|tanh|sigmoid|"
                          r"gelu|layer_norm|batch_norm|max_pool\dd|avg_pool\dd|linear|mul|add|sub|div|pow|sqrt|"
                          r"clamp|argmax|argmin|cumsum|prod|norm|var|std|einsum|baddbmm)\s*\(")


class Finding(BaseModel):
    rule: str
    message: str
    line: int | None = None


class PolicyReport(BaseModel):
    mode: Mode
    violations: list[Finding] = Field(default_factory=list)
    warnings: list[Finding] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        return "; ".join(f"line {f.line}: {f.message}" if f.line else f.message for f in self.violations)


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _strings(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _triton_kernels(tree: ast.AST) -> set[str]:
    """Names of functions decorated with Triton's own ``jit`` (``triton.jit``, or ``jit`` imported
    from triton, with or without arguments): a look-alike ``@jit`` of the candidate's own is not one."""
    modules = {"triton"}
    jits = {"triton.jit"}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            modules |= {a.asname or a.name for a in n.names if a.name == "triton"}
        elif isinstance(n, ast.ImportFrom) and n.module == "triton":
            jits |= {a.asname or a.name for a in n.names if a.name == "jit"}
    jits |= {f"{m}.jit" for m in modules}
    local = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    jits -= local  # a function of the candidate's own named jit shadows the import
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and any(_dotted(d.func if isinstance(d, ast.Call) else d) in jits for d in n.decorator_list)}


def check_policy(code: str, backend: str, mode: Mode = "strict") -> PolicyReport:
    """Check a candidate's source against the policy for ``backend`` (cpu | triton | cuda)."""
    rep = PolicyReport(mode=mode)
    try:
        tree = ast.parse(code)
    except SyntaxError:  # not a policy matter: loading reports it as a load error
        return rep

    def bad(rule: str, msg: str, node: ast.AST | None = None) -> None:
        rep.violations.append(Finding(rule=rule, message=msg, line=getattr(node, "lineno", None)))

    def soft(rule: str, msg: str, node: ast.AST | None = None) -> None:
        (rep.violations if mode == "strict" else rep.warnings).append(
            Finding(rule=rule, message=msg, line=getattr(node, "lineno", None)))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                root = name.split(".")[0]
                if root in FORBIDDEN_MODULES:
                    bad("forbidden_import", f"imports {name} (threads, processes, I/O, introspection or timers "
                                            "are not allowed in a kernel)", node)
            if isinstance(node, ast.ImportFrom) and any(a.name == "Model" for a in node.names):
                bad("reference_access", "imports the reference Model", node)
        elif isinstance(node, ast.Try):
            if node.handlers:
                bad("try_except", "try/except is not allowed (a fallback to the reference hides failures)", node)
        elif isinstance(node, ast.Call):
            fname = _dotted(node.func)
            if fname in FORBIDDEN_CALLS:
                bad("forbidden_call", f"calls {fname}()", node)
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRS:
            bad("forbidden_attribute", f"uses .{node.attr}", node)
        elif isinstance(node, ast.Name) and node.id in {"__builtins__", "__loader__", "__spec__"}:
            bad("forbidden_attribute", f"uses {node.id}", node)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute):
                        root = _dotted(sub).split(".")[0]
                        if root in PATCHABLE_ROOTS:
                            bad("monkeypatch", f"assigns {_dotted(sub)} (patching library functions, timers or "
                                               "synchronisation is not allowed)", node)
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                bname = _dotted(base)
                if bname.split(".")[-1] == "Model":
                    bad("subclass_reference", f"class {node.name} subclasses the reference Model", node)
                if bname.split(".")[-1] in {"Tensor", "_TensorBase"}:
                    bad("tensor_subclass", f"class {node.name} subclasses torch.Tensor", node)

    sources = _strings(tree)
    cpp = "\n".join(s for s in sources if "(" in s and ("{" in s or "#include" in s))
    for pattern, msg in CPP_CHEATS:
        if pattern.search(cpp):
            bad("cpp_threads", msg)
    if backend in ("cpu", "cuda"):
        if ATEN_COMPUTE.search(cpp) or ATEN_METHODS.search(cpp):
            m = ATEN_COMPUTE.search(cpp) or ATEN_METHODS.search(cpp)
            soft("aten_compute", f"the C++ calls ATen/torch compute ({m.group(0).strip()}...), not a kernel of its own")

    # a real kernel for the backend
    calls = {_dotted(n.func).split(".")[-1]: n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    if backend == "cpu":
        li = calls.get("load_inline")
        if li is None:
            bad("no_kernel", "no C++ kernel: the cpu backend needs torch.utils.cpp_extension.load_inline(cpp_sources=...)")
        elif any(k.arg == "cuda_sources" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
                 for k in li.keywords):
            bad("wrong_backend", "cuda_sources given to the cpu backend")
    elif backend == "cuda":
        if "load_inline" not in calls or "__global__" not in "\n".join(sources):
            bad("no_kernel", "no CUDA kernel: the cuda backend needs load_inline(cuda_sources=...) with a __global__ function")
    elif backend == "triton":
        kernels = _triton_kernels(tree)
        if not kernels:
            bad("no_kernel", "no Triton kernel: the triton backend needs a @triton.jit function")
        elif not any(isinstance(n.func, ast.Subscript) and _dotted(n.func.value) in kernels
                     for n in ast.walk(tree) if isinstance(n, ast.Call)):
            bad("no_kernel", f"the Triton kernel ({', '.join(sorted(kernels))}) is never launched (kernel[grid](...))")

    # strict: ModelNew.forward must not compute with torch itself
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ModelNew"):
        nn_attrs = set()
        for n in ast.walk(cls):
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
                fn = _dotted(n.value.func)
                if fn.startswith(("nn.", "torch.nn.")) and not fn.endswith(("Parameter", "ParameterList", "Module")):
                    for t in n.targets:
                        if isinstance(t, ast.Attribute):
                            nn_attrs.add(t.attr)
        for fdef in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"):
            for n in ast.walk(fdef):
                if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
                    soft("torch_compute", "forward uses the @ operator (torch matmul)", n)
                if not isinstance(n, ast.Call):
                    continue
                fn = _dotted(n.func)
                head, _, last = fn.rpartition(".")
                if head in ("torch", "F", "torch.nn.functional", "torch.special", "torch.linalg", "torch.fft") and \
                        last not in ALLOWED_TORCH_IN_FORWARD:
                    soft("torch_compute", f"forward calls {fn} (torch computes it, not the kernel)", n)
                elif head == "self" and last in nn_attrs:
                    soft("torch_compute", f"forward calls the torch.nn module self.{last}", n)
    return rep
