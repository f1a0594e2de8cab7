#!/usr/bin/env bash
# Issue #48's speed figure: a Qwen3.5-2B-shaped hybrid GGUF (18 Gated DeltaNet layers, 6
# gated attention layers; random weights in llama.cpp's Q4_K_M mix, pagoda.bench.gguf_files)
# served by pagoda (its default mode for the file, the gguf mode, and the int8 mode) and by llama-server -t 2 in the same run,
# 128 tokens in, 128 out, at 1 and 16 streams. One server at a time; keep the machine quiet.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=docs/results
M=${MODELS:-/tmp/models}
mkdir -p "$M"
$PY benchmarks/compare.py install llama-server     # a no-op once built
[ -f "$M/qwen3.5-2b-q4_k_m.gguf" ] || $PY -m pagoda.bench.gguf_files qwen3.5-2b "$M/qwen3.5-2b-q4_k_m.gguf" --type Q4_K_M
$PY benchmarks/compare.py run --model "$M/qwen3.5-2b-q4_k_m.gguf" --engines pagoda,pagoda-int8,llama-server \
  --threads 2 --concurrency 1,16 --num-prompts 4,16 --input-len 128 --output-len 128 --out-dir "$OUT/hybrid-qwen35-2b"
$PY benchmarks/compare.py table "$OUT/hybrid-qwen35-2b"
