#!/usr/bin/env bash
# The commands behind docs/benchmarks.md: its numbers (docs/results/) and plots (docs/img/).
# One server at a time, engine after engine at each concurrency, each run first waiting
# (at most 30 s) for the shared machine's 1-minute load average to fall below 1.5.
# About 30 min on 2 quiet cores (about an hour under heavy contention), plus the
# llama-server build (15-25 min, once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=docs/results
QUIET=(--wait-quiet 1.5 --wait-quiet-max-s 30)

$PY benchmarks/compare.py install llama-server     # incremental: a no-op once built
$PY benchmarks/compare.py run --engines pagoda,llama-server,hf --concurrency 1,4,16,64 \
  --num-prompts 2,4,16,64 --input-len 128 --output-len 128 "${QUIET[@]}" --out-dir "$OUT/compare"
$PY benchmarks/compare.py table "$OUT/compare" --plot-dir docs/img

$PY benchmarks/compare.py prefix --prefix-len 1024 --input-len 64 --output-len 8 --concurrency 4 \
  --num-prompts 8 "${QUIET[@]}" --out-dir "$OUT/prefix"

wait_quiet() { $PY -c "import sys; sys.path.insert(0, 'benchmarks'); import compare; compare.wait_quiet(1.5, 30)"; }
wait_quiet
.venv/bin/pagoda bench roofline --save-result "$OUT/roofline.json" --plot docs/img/roofline.png
wait_quiet
.venv/bin/pagoda bench latency --batch-size 8 --input-len 128 --output-len 32 --num-iters 2 \
  --num-kv-blocks 1024 --save-result "$OUT/latency.json"
