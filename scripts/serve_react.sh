#!/usr/bin/env bash
# Interactive serving, offline: build the tiny model, serve it over HTTP, run the `react` agent graph
# against the server through the openai: backend with the arithmetic tools, print the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT_DIR:-out}
PORT=${PORT:-8765}
mkdir -p "$OUT"
# The default build (the agent preset, as the README's): kept when $OUT/tiny already holds it, copied
# from the build cache when this machine built it before, rebuilt when it holds another build.
closedloop model tiny "$OUT/tiny"
closedloop serve --model "hf:$OUT/tiny" --served-name tiny --host 127.0.0.1 --port "$PORT" >"$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 240); do
  python -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/v1/models', timeout=1).status_code != 200)" \
    2>/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$OUT/serve.log"; exit 1; }
  sleep 0.5
done
closedloop run react --model "openai:tiny@http://127.0.0.1:$PORT/v1" --tools arithmetic \
  --input "${INPUT:-What is 3 plus 4?}" --store "$OUT/runs.duckdb"
closedloop runs list --store "$OUT/runs.duckdb" --limit 5
latest=$(closedloop runs list --store "$OUT/runs.duckdb" --limit 1 --json | python -c "import json,sys; print(json.load(sys.stdin)[0]['id'])")
closedloop runs show "$latest" --store "$OUT/runs.duckdb"
