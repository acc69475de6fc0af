"""KernelBench-compatible kernel evaluation on CPU (C++/OpenMP), Triton (interpreter) and CUDA.

Problems come from a user path in KernelBench's layout or from dataset rows; nothing is vendored.
Every candidate runs in :mod:`closedloop.sandbox`; see ``evaluate.py`` for the checks.
"""

from closedloop.evals.kernelbench.problems import Problem, load_problems, problems_from_rows, scale_source

__all__ = ["Problem", "load_problems", "problems_from_rows", "scale_source"]
