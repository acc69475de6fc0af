"""Sample inputs shipped with closedloop, so every documented journey has an offline example.

``kernelbench``: three problems in KernelBench's layout (``level1/<id>_<Name>.py``: ReLU, a
scale-and-add, a ReLU of positive inputs) and ``kernelbench-candidates``: a correct C++ kernel for
problem 1 (``1_ReLU.py``, the form ``--candidates`` reads). KernelBench itself ships nothing
runnable offline (its problems come from the KernelBench repository or its dataset). The τ-bench
sample is the ``helpdesk`` domain, whose data ships beside its code.

``python -m closedloop.samples NAME`` prints a sample's folder, for a command line::

    closedloop eval kernelbench --problems "$(python -m closedloop.samples kernelbench)" --level 1 ...
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SAMPLES", "sample_path"]

_HERE = Path(__file__).resolve().parent

#: Sample name -> its folder.
SAMPLES = {"kernelbench": _HERE / "kernelbench", "kernelbench-candidates": _HERE / "kernelbench" / "candidates"}


def sample_path(name: str) -> Path:
    """The folder of a sample; ``KeyError`` naming the samples there are."""
    if name not in SAMPLES:
        raise KeyError(f"no sample named {name!r}; samples: {', '.join(SAMPLES)}")
    return SAMPLES[name]
