"""Shared, session-scoped KernelBench fixtures: one build cache for the whole session, so every
candidate that uses the shared ReLU kernel (the correct one and several hostile ones) compiles
once, and every attack that needs native code shares one "attack kit" extension (one more build).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from closedloop.evals.kernelbench.evaluate import KernelEvalConfig, KernelEvaluator
from closedloop.evals.kernelbench.problems import load_problems
from closedloop.samples import sample_path
from closedloop.sandbox import SandboxLimits

HERE = Path(__file__).parent
PROBLEMS = sample_path("kernelbench")  # the problems that ship with the package, as a user runs them
RELU_OK = (HERE / "candidates" / "relu_ok.py").read_text()
# The kernel every shared candidate uses, verbatim from relu_ok.py (same source, same cache key).
KERNEL = RELU_OK.split("class ModelNew")[0]
#: A well-formed key nobody builds: the kit's builder-side initializer plants a library under it.
PLANTED_KEY = "0123456789abcdef0123456789abcdef"

# What an attacker with a real C++ kernel in hand can do natively. Each function is one attack
# capability; ``relu_spin`` is a correct ReLU that first wastes ``spin`` iterations (a slow kernel
# whose only hope of a speedup is an attack). The static initializer runs where the library is
# loaded: in the trusted builder (TORCH_EXTENSIONS_DIR set) it plants a library for a key it was
# not asked to build and tries to write outside its staging directory.
KIT_SOURCE = r"""
#include <torch/extension.h>
#include <spawn.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <omp.h>
extern char **environ;

static int planted = [] {
    const char* dir = getenv("TORCH_EXTENSIONS_DIR");
    if (dir) {
        std::string d(dir);
        mkdir((d + "/PLANTED_KEY").c_str(), 0700);
        FILE* f = fopen((d + "/PLANTED_KEY/kb_relu_ok.so").c_str(), "w");
        if (f) { fputs("not a library", f); fclose(f); }
        FILE* g = fopen((d + "/../closedloop-kit-escaped").c_str(), "w");
        if (g) { fclose(g); }
    }
    return 0;
}();

static void relu_into(const float* in, float* o, int64_t n) {
    for (int64_t i = 0; i < n; ++i) o[i] = in[i] > 0.f ? in[i] : 0.f;
}

torch::Tensor relu_spin(torch::Tensor x, int64_t spin) {
    volatile int64_t sink = 0;
    for (int64_t i = 0; i < spin; ++i) sink = sink + i;
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    relu_into(xc.data_ptr<float>(), out.data_ptr<float>(), xc.numel());
    return out;
}

torch::Tensor relu_threads(torch::Tensor x, int64_t threads) {
    omp_set_num_threads((int)threads);
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    const float* in = xc.data_ptr<float>();
    float* o = out.data_ptr<float>();
    const int64_t n = xc.numel();
    #pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) o[i] = in[i] > 0.f ? in[i] : 0.f;
    return out;
}

int64_t spawn(std::string cmd) {
    pid_t pid;
    char* argv[] = {(char*)"/bin/sh", (char*)"-c", (char*)cmd.c_str(), nullptr};
    return posix_spawn(&pid, "/bin/sh", nullptr, nullptr, argv, environ) == 0 ? (int64_t)pid : -1;
}

bool write_file(std::string path, std::string text) {
    FILE* f = fopen(path.c_str(), "w");
    if (!f) return false;
    fputs(text.c_str(), f);
    fclose(f);
    return true;
}

void exit_now(int64_t code) { _exit((int)code); }

int64_t fork_sleeper() {
    pid_t p = fork();
    if (p == 0) { sleep(600); _exit(0); }
    return (int64_t)p;
}

void spin_thread() {
    std::thread([] { volatile uint64_t k = 0; for (;;) k = k + 1; }).detach();
}

int64_t write_fd(int64_t fd, std::string data) { return (int64_t)write((int)fd, data.data(), data.size()); }
""".replace("PLANTED_KEY", PLANTED_KEY)

KIT = ("import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n\n"
       f"KIT_SOURCE = r'''{KIT_SOURCE}'''\n\n"
       "kit = load_inline(name='kb_attack_kit', cpp_sources=KIT_SOURCE, functions=['relu_spin', 'relu_threads', "
       "'spawn', 'write_file', 'exit_now', 'fork_sleeper', 'spin_thread', 'write_fd'], "
       "extra_cflags=['-O1', '-fopenmp'], extra_ldflags=['-fopenmp'])\n")


def config(cache: Path, **kw) -> KernelEvalConfig:
    base = dict(cache_dir=str(cache), scale=0.25, trials=3, warmup=1, iters=5, compile_workers=2,
                limits=SandboxLimits(wall_s=120, cpu_s=60, memory_mb=4096, processes=128, file_size_mb=256,
                                     open_files=512))
    base.update(kw)
    return KernelEvalConfig(**base)


@pytest.fixture(scope="session")
def kb_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="session")
def problems() -> dict[int, object]:
    return {p.problem_id: p for p in load_problems(PROBLEMS, level=1)}


@pytest.fixture(scope="session")
def relu_result(kb_cache, problems):
    """The correct CPU kernel, evaluated once (this is the one build of the session)."""
    return KernelEvaluator(config(kb_cache)).evaluate(problems[1], RELU_OK)
