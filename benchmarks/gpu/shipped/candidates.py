"""The kernels the GPU check ships, as KernelBench candidates (source text of a module that
defines ``ModelNew``), and the problems they are for.

CUDA: one extension serves the three problems (``kernels.cu`` for nvcc, ``kernels.cpp`` for the
torch wrappers). Every CUDA candidate makes the identical ``load_inline`` call, so the harness's
build cache builds it once (a torch extension takes about a minute to build). Triton: one file per
problem under ``triton/``. The problems are KernelBench's level-1 files, verbatim, under
``problems/level1/`` (MIT licence, ``problems/LICENSE``).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
PROBLEMS = HERE / "problems"
#: problem id -> KernelBench file stem: the three problems with shipped CUDA and Triton kernels
KERNEL_PROBLEMS = {88: "88_MinGPTNewGelu", 40: "40_LayerNorm", 95: "95_CrossEntropyLoss"}
EXTENSION = "gpu_check_kernels"


def _sources(stem: str) -> tuple[str, str]:
    cu, cpp = (HERE / f"{stem}.cu").read_text(), (HERE / f"{stem}.cpp").read_text()
    if '"""' in cu + cpp:
        raise ValueError(f"{stem}: the sources must not hold triple quotes (they are embedded in a raw string)")
    return cu, cpp


def extension_header(stem: str, name: str, functions: list[str]) -> str:
    """The imports and the ``load_inline`` call of a candidate whose kernels are ``stem``.cu/.cpp."""
    cu, cpp = _sources(stem)
    return ("import torch\nimport torch.nn as nn\nfrom torch.utils.cpp_extension import load_inline\n\n"
            f'CUDA_SOURCE = r"""{cu}"""\n\nCPP_SOURCE = r"""{cpp}"""\n\n'
            f"ext = load_inline(name={name!r}, cpp_sources=CPP_SOURCE, cuda_sources=CUDA_SOURCE,\n"
            f"                  functions={functions!r},\n"
            "                  extra_cflags=['-O3'], extra_cuda_cflags=['-O3'])\n")


_MODELS = {
    88: '''

class ModelNew(nn.Module):
    """minGPT's tanh GELU in one fused kernel: one read and one write (eager torch makes eight passes)."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.gelu_tanh(x)
''',
    40: '''

class ModelNew(nn.Module):
    """LayerNorm over the trailing dimensions: per-chunk sums over the whole GPU, per-row statistics
    in double, then the affine map with each weight read once (eager torch gives each of the 16
    rows of 4M values to one block)."""

    def __init__(self, normalized_shape):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))
        self.eps = 1e-5

    def forward(self, x):
        return ext.layer_norm(x, self.weight, self.bias, self.eps)
''',
    95: '''

class ModelNew(nn.Module):
    """Cross-entropy, mean over rows: an online log-sum-exp per row (one pass over the logits),
    then the mean in double (ignore_index -100 as torch)."""

    def __init__(self):
        super().__init__()

    def forward(self, predictions, targets):
        return ext.cross_entropy(predictions, targets)
''',
}


def cuda_candidate(problem_id: int) -> str:
    return extension_header("kernels", EXTENSION, ["gelu_tanh", "layer_norm", "cross_entropy"]) + _MODELS[problem_id]


def triton_candidate(problem_id: int) -> str:
    return (HERE / "triton" / f"{KERNEL_PROBLEMS[problem_id]}.py").read_text()


def problem_file(problem_id: int) -> Path:
    found = sorted((PROBLEMS / "level1").glob(f"{problem_id}_*.py"))
    if len(found) != 1:
        raise FileNotFoundError(f"no single level-1 problem {problem_id} under {PROBLEMS}")
    return found[0]
