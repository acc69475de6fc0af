"""Static policy for candidates: an AST check (and patterns over the C++ sources) run before any
candidate code executes.

Why AST and not regexes (KernelBench's checker): names in strings, comments or aliases
(``import threading as t``) fool a regex; the AST sees what the code does. The policy is a first
filter, not the boundary: the judge (``judge.py``) runs the candidate in a process of its own,
out of reach of the reference, the comparison and the clock, and stays sound with the policy off.
What it refuses is what a kernel has no use for and an attack does: processes, threads, dynamic
loading, file and raw memory access (``ctypes``, ``numpy.ctypeslib``), introspection and
``importlib``/``operator`` tricks, torch dispatch and function modes, hooks, monkeypatching; in
the C++: process creation, ``system``/``exec*``/``posix_spawn``/``dlopen``, file opens, exiting the
process, signals, raw syscalls and inline assembly.

Modes: ``strict`` also forbids torch compute ops (``torch.*``, ``F.*``, ``nn`` compute modules,
``@``) inside ``ModelNew.forward`` and ATen compute calls inside the C++, and requires a real
kernel for the backend; ``lenient`` reports those as warnings (a pure-PyTorch candidate is then
judged on correctness and speed like any other).
"""

from __future__ import annotations

import ast
import re
from typing import Literal

from pydantic import BaseModel, Field

Mode = Literal["strict", "lenient"]

FORBIDDEN_MODULES = {"threading", "multiprocessing", "concurrent", "subprocess", "socket", "signal", "gc",
                     "inspect", "ctypes", "_ctypes", "cffi", "asyncio", "_thread", "pty", "shutil", "urllib", "http",
                     "requests", "importlib", "builtins", "pickle", "marshal", "resource", "sys", "os", "posix",
                     "pathlib", "tempfile", "io", "traceback", "weakref", "time", "timeit", "cProfile", "profile",
                     "operator", "types", "mmap", "select", "fcntl", "code", "codeop", "runpy",
                     "pkgutil", "atexit", "faulthandler", "tracemalloc", "sysconfig", "site", "closedloop",
                     "copyreg", "dis", "ast"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "globals", "vars", "locals", "setattr", "delattr",
                   "getattr", "open", "breakpoint", "input"}
FORBIDDEN_ATTRS = {"_getframe", "f_back", "f_globals", "f_locals", "__globals__", "__subclasses__", "__code__",
                   "__builtins__", "_make_subclass", "fork", "system", "popen", "spawn", "register_forward_hook",
                   "register_forward_pre_hook", "register_full_backward_hook", "register_backward_hook",
                   "register_module_forward_hook", "register_module_forward_pre_hook", "register_hook",
                   "register_module_full_backward_hook", "_global_forward_hooks", "_global_forward_pre_hooks",
                   "synchronize", "__class__", "__bases__", "__mro__", "__dict__", "__setattr__", "__getattribute__",
                   "__torch_function__", "__torch_dispatch__", "__reduce__", "__reduce_ex__", "__del__",
                   "set_num_threads", "set_num_interop_threads", "set_flush_denormal", "allow_tf32",
                   "get_objects", "get_referrers", "ctypeslib", "ctypes", "_C", "library", "overrides",
                   "_python_dispatch", "TorchFunctionMode", "TorchDispatchMode", "_dynamo", "load_library",
                   "manual_seed", "set_rng_state", "get_rng_state"}
#: Names imported from torch that change how torch dispatches or what an op does.
FORBIDDEN_FROM = {"TorchFunctionMode", "TorchDispatchMode", "library", "overrides", "_C", "_python_dispatch",
                  "register_module_forward_hook", "register_module_forward_pre_hook", "ctypeslib"}
PATCHABLE_ROOTS = {"torch", "time", "F", "nn", "np", "numpy", "math", "triton", "tl", "cpp_extension"}
ALLOWED_TORCH_IN_FORWARD = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "tensor", "as_tensor",
                            "no_grad", "device", "Size", "float32", "float16", "bfloat16", "int64", "int32",
                            "bool", "is_tensor"}
_FREE = r"(?<![\w.>:])(?:::)?"  # a free function (not a member, not std::remove and its like)
CPP_CHEATS = [
    (re.compile(r"\bstd::(thread|async|jthread)\b|\bpthread_create\b|\bomp_set_num_threads\b|\bnum_threads\s*\(|"
                r"<thread>|<future>"), "cpp_threads", "threads in C++ beyond the configured OpenMP threads"),
    (re.compile(_FREE + r"(v?fork|clone3?|posix_spawnp?|system|popen|exec[lv]p?e?|execveat|fexecve|daemon)\s*\(|"
                r"<spawn\.h>"), "cpp_process", "process creation in C++ (fork, posix_spawn, system, exec*)"),
    (re.compile(_FREE + r"(dlopen|dlmopen|dlsym|dlvsym)\s*\(|<dlfcn\.h>"), "cpp_dlopen", "dynamic loading in C++ (dlopen)"),
    (re.compile(_FREE + r"(fopen|fopen64|freopen|fdopen|open|open64|openat|openat2|creat|mkstemp|tmpfile|unlink|remove|"
                r"rename|truncate|ftruncate|mmap|mprotect|memfd_create|shm_open|socket|connect|ptrace|process_vm_\w+)\s*\(|"
                r"\b(std::)?[io]?fstream\b|<fstream>|<sys/mman\.h>|<sys/socket\.h>"),
     "cpp_file", "file, memory-mapping or socket access in C++"),
    (re.compile(_FREE + r"(_exit|_Exit|exit|quick_exit|abort|kill|raise|signal|sigaction|setjmp|longjmp)\s*\(|"
                r"\bstd::(exit|abort|quick_exit|_Exit|terminate)\b|<csignal>|<signal\.h>|<unistd\.h>|<sys/syscall\.h>"),
     "cpp_exit", "exiting the process, signals or unistd calls in C++"),
    (re.compile(r"\bsyscall\s*\(|\b(__)?asm(__)?\b|##|\bgetenv\s*\(|\bsetenv\s*\(|\bputenv\s*\("),
     "cpp_raw", "raw syscalls, inline assembly, token pasting or the environment in C++"),
]
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


def _strip_comments(cpp: str) -> str:
    """C++ without its comments (so a comment neither triggers nor hides a pattern)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", " ", cpp, flags=re.S)


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

    imported = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                parts = name.split(".")
                if parts[0] in FORBIDDEN_MODULES or any(p in FORBIDDEN_FROM or p == "ctypeslib" for p in parts[1:]):
                    bad("forbidden_import", f"imports {name} (threads, processes, I/O, introspection, dispatch "
                                            "hooks or timers are not allowed in a kernel)", node)
            if isinstance(node, ast.ImportFrom):
                if any(a.name == "Model" for a in node.names):
                    bad("reference_access", "imports the reference Model", node)
                for a in node.names:
                    if a.name in FORBIDDEN_FROM or a.name in FORBIDDEN_ATTRS:
                        bad("forbidden_import", f"imports {a.name} from {node.module}", node)
        elif isinstance(node, ast.Try):
            if node.handlers:
                bad("try_except", "try/except is not allowed (a fallback to the reference hides failures)", node)
        elif isinstance(node, ast.Call):
            fname = _dotted(node.func)
            if fname in FORBIDDEN_CALLS:
                bad("forbidden_call", f"calls {fname}()", node)
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRS:
            bad("forbidden_attribute", f"uses .{node.attr}", node)
        elif isinstance(node, ast.Name) and node.id in {"__builtins__", "__loader__", "__spec__", "__import__"}:
            bad("forbidden_attribute", f"uses {node.id}", node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in FORBIDDEN_MODULES | {
                "ctypeslib", "__import__"}:
            bad("forbidden_name", f"names {node.value!r} in a string (importing by name)", node)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute):
                        root = _dotted(sub).split(".")[0]
                        if root in PATCHABLE_ROOTS or root in imported:
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
    cpp = _strip_comments("\n".join(s for s in sources if "(" in s and ("{" in s or "#include" in s)))
    for pattern, rule, msg in CPP_CHEATS:
        m = pattern.search(cpp)
        if m:
            bad(rule, f"{msg}: {m.group(0).strip()}")
    if backend in ("cpu", "cuda"):
        if m := ATEN_COMPUTE.search(cpp) or ATEN_METHODS.search(cpp):
            soft("aten_compute", f"the C++ calls ATen/torch compute ({m.group(0).strip()}...), not a kernel of its own")

    # a real kernel for the backend
    # a real kernel for the backend: required in strict mode; lenient judges a candidate without one
    # on correctness and speed like any other
    calls = {_dotted(n.func).split(".")[-1]: n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    if backend == "cpu":
        li = calls.get("load_inline")
        if li is None:
            soft("no_kernel", "no C++ kernel: the cpu backend needs torch.utils.cpp_extension.load_inline(cpp_sources=...)")
        elif any(k.arg == "cuda_sources" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
                 for k in li.keywords):
            bad("wrong_backend", "cuda_sources given to the cpu backend")
    elif backend == "cuda":
        if "load_inline" not in calls or "__global__" not in "\n".join(sources):
            soft("no_kernel", "no CUDA kernel: the cuda backend needs load_inline(cuda_sources=...) with a __global__ function")
    elif backend == "triton":
        kernels = _triton_kernels(tree)
        if not kernels:
            soft("no_kernel", "no Triton kernel: the triton backend needs a @triton.jit function")
        elif not any(isinstance(n.func, ast.Subscript) and _dotted(n.func.value) in kernels
                     for n in ast.walk(tree) if isinstance(n, ast.Call)):
            soft("no_kernel", f"the Triton kernel ({', '.join(sorted(kernels))}) is never launched (kernel[grid](...))")

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
