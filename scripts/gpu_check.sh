#!/usr/bin/env bash
# The GPU check (issue 32): the cuda KernelBench backend, Triton timing, SFT/GRPO at Qwen2-0.5B's
# shape against TRL, closedloop serve against transformers serve, and EGG's profile step with
# Nsight Compute, in <= 8 minutes on one GPU, into one report (report.json, report.md, log.txt).
#
#   bash scripts/gpu_check.sh --prepare-wheels        # here, with a package index: fill .whl/ (see README)
#   bash scripts/gpu_check.sh --out DIR               # on the GPU machine (installs .whl/ first)
#   bash scripts/gpu_check.sh --dry-run --out DIR     # on a CPU, tiny sizes: what CI runs
#   bash scripts/gpu_check.sh --parts triton,egg_profile --out DIR   # some parts only
#
# On the GPU machine nothing can be downloaded: the wheels in .whl/ (prepared here) are installed
# into a virtual environment that also sees the image's own packages (PyTorch, Triton, ...).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--prepare-wheels" ]]; then
    shift
    exec "${PYTHON:-python3}" benchmarks/gpu/wheels.py prepare "$@"
fi

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [[ " $* " != *" --dry-run "* && -d .whl ]] && compgen -G ".whl/*.whl" > /dev/null; then
    VENV=${GPU_CHECK_VENV:-/tmp/gpu-check-venv}
    if [[ ! -x "$VENV/bin/python" ]]; then
        python3 -m venv --system-site-packages "$VENV"
        "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
        "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
    fi
    PY="$VENV/bin/python"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" benchmarks/gpu/check.py "$@"
