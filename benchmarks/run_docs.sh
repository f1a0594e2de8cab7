#!/usr/bin/env bash
# The commands behind docs/benchmarks.md: its numbers (docs/results/) and plots (docs/img/).
# One server at a time, engine after engine at each concurrency. Under the contention these
# numbers were taken in (other developers' test suites on the same 2 cores) this took about
# 50 min, plus the llama-server build (15-25 min, once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=docs/results
QUIET=(--wait-quiet 1.5 --wait-quiet-max-s 30)

$PY benchmarks/compare.py install llama-server     # incremental: a no-op once built

# 1. Default thread counts (pagoda: torch's own, one per core; llama-server -t 2).
#    c=64 was left out: at the speeds contention left, it alone would have taken ~45 min.
$PY benchmarks/compare.py run --engines pagoda,llama-server,hf --concurrency 1,4,16 \
  --num-prompts 2,4,16 --input-len 128 --output-len 128 "${QUIET[@]}" --out-dir "$OUT/compare"
$PY benchmarks/compare.py table "$OUT/compare" --plot-dir docs/img

# 2. One thread per engine, which is what a contended machine can give each.
$PY benchmarks/compare.py run --engines pagoda,llama-server --threads 1 --pagoda-threads 1 \
  --concurrency 1,4,16,64 --num-prompts 8,16,32,64 --input-len 128 --output-len 128 \
  --out-dir "$OUT/compare-1thread"
$PY benchmarks/compare.py table "$OUT/compare-1thread" --plot-dir docs/img/1thread

wait_quiet() { $PY -c "import sys; sys.path.insert(0, 'benchmarks'); import compare; compare.wait_quiet(1.5, 30)"; }
wait_quiet
.venv/bin/pagoda bench roofline --context-lens 128,512 --decode-batch-sizes 1,4,16,64 --prefill-lens 32,128,512 \
  --min-time 0.5 --save-result "$OUT/roofline.json" --plot docs/img/roofline.png
OMP_NUM_THREADS=1 .venv/bin/pagoda bench roofline --context-lens 128,512 --decode-batch-sizes 1,4,16,64 \
  --prefill-lens 32,128,512 --min-time 0.5 --save-result "$OUT/roofline-1thread.json" --plot docs/img/roofline-1thread.png
OMP_NUM_THREADS=1 .venv/bin/pagoda bench latency --batch-size 8 --input-len 128 --output-len 32 --num-iters 2 \
  --num-kv-blocks 1024 --save-result "$OUT/latency-1thread.json"
OMP_NUM_THREADS=1 $PY benchmarks/compare.py prefix --prefix-len 1024 --input-len 64 --output-len 8 --concurrency 4 \
  --num-prompts 8 --out-dir "$OUT/prefix-1thread"
