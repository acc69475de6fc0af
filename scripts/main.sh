#!/usr/bin/env bash
# The main job, offline: build the tiny model, serve it over HTTP, run the `react` agent graph
# against the server through the openai: backend with the arithmetic tools, print the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT_DIR:-out}
PORT=${PORT:-8765}
mkdir -p "$OUT"
[ -f "$OUT/tiny/config.json" ] || closedloop model tiny "$OUT/tiny"
closedloop serve --model "hf:$OUT/tiny" --served-name tiny --host 127.0.0.1 --port "$PORT" >"$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$OUT/serve.log"; exit 1; }
  sleep 0.5
done
closedloop run react --model "openai:tiny@http://127.0.0.1:$PORT/v1" --tools arithmetic \
  --input "${INPUT:-What is 3 plus 4?}" --store "$OUT/runs.duckdb"
closedloop runs list --store "$OUT/runs.duckdb" --limit 5
closedloop runs show "$(closedloop runs list --store "$OUT/runs.duckdb" --limit 1 --ids-only)" --store "$OUT/runs.duckdb"
