#!/usr/bin/env bash
# The commands behind docs/benchmarks.md's "CPU fast path" section (issue #5): pagoda's three
# modes (exact fp32, int8, q4) against llama-server on the same GGUF, one thread each
# (pagoda's default on a 2-core machine; llama-server -t 1), then the same at two threads.
# One server at a time; about 25 minutes on a quiet 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=docs/results

$PY benchmarks/compare.py install llama-server     # incremental: a no-op once built

$PY benchmarks/compare.py run --engines pagoda,pagoda-int8,pagoda-q4,llama-server --threads 1 \
  --concurrency 1,16,64 --num-prompts 4,32,64 --input-len 128 --output-len 128 \
  --out-dir "$OUT/fastpath-1thread"
$PY benchmarks/compare.py table "$OUT/fastpath-1thread" --plot-dir docs/img/fastpath-1thread

for mode in none int8 q4; do
  .venv/bin/pagoda bench roofline --quantization $mode --context-lens 128,512 --decode-batch-sizes 1,16,64 \
    --prefill-lens 128 --min-time 0.5 --no-bf16 --save-result "$OUT/roofline-$mode.json"
done
