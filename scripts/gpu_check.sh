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
# On the GPU machine nothing can be downloaded: the wheels in .whl/ (prepared here, carried with
# `carry: [".whl"]`) and closedloop itself are installed beside the image's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [[ "${1:-}" == "--prepare-wheels" ]]; then
    shift
    exec "$PY" benchmarks/gpu/wheels.py prepare "$@"
fi
if [[ " $* " != *" --dry-run "* ]] && compgen -G ".whl/*.whl" > /dev/null; then
    # The device machine's python3 is itself a virtual environment (PyTorch, Triton, transformers):
    # a venv made from it would not see those, so the wheels and closedloop go into a folder on
    # PYTHONPATH instead (setuptools is in the image: closedloop builds from this tree, offline).
    SITE=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
    if [[ ! -f "$SITE/.installed" ]]; then
        "$PY" benchmarks/gpu/wheels.py verify
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
            --target "$SITE" .whl/*.whl .
        touch "$SITE/.installed"
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" benchmarks/gpu/check.py "$@"
