#!/usr/bin/env bash
# The main job, offline, on a CPU: `closedloop demo` builds the tiny model, fine-tunes it with SFT on
# expert trajectories of the calc environment, then with multi-turn GRPO on rollouts of the react
# graph, and evaluates base, SFT and GRPO on held-out seeds (table, results.json, demo.png, run store).
# Extra arguments go to `closedloop demo` (e.g. --quick, --model hf:PATH, --set grpo_steps=80). The demo
# is the built-in recipe `demo`: run again, its finished stages are skipped (out/demo/recipe.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
closedloop demo --out "${OUT_DIR:-out}/demo" "$@"
