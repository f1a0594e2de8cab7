#!/usr/bin/env bash
# The commands behind docs/benchmarks.md's "Real-size models" section (issue #20): random-
# weight GGUF files of real shapes (pagoda.bench.gguf_files; Q4_K_M written directly in
# llama.cpp's type mix, and one made by llama.cpp's own llama-quantize from an F16 file),
# served by pagoda's exact and gguf modes and by llama-server at its best thread count on
# this 2-core machine (-t 2). One server at a time; 128-token prompts, 64 output tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=docs/results
M=${MODELS:-/tmp/models}
mkdir -p "$M"

$PY benchmarks/compare.py install llama-server     # builds llama-server and llama-quantize; a no-op once built
QUANTIZE=$(dirname "$($PY -c 'import sys; sys.path.insert(0, "benchmarks"); import peers; print(peers.llama_server_binary(peers.DEFAULT_CACHE))')")/llama-quantize

[ -f "$M/llama-3.2-1b-f16.gguf" ] || $PY -m pagoda.bench.gguf_files llama-3.2-1b "$M/llama-3.2-1b-f16.gguf" --type F16
[ -f "$M/llama-3.2-1b-q4_k_m.gguf" ] || "$QUANTIZE" "$M/llama-3.2-1b-f16.gguf" "$M/llama-3.2-1b-q4_k_m.gguf" Q4_K_M 2
[ -f "$M/llama-3.1-8b-q4_k_m.gguf" ] || $PY -m pagoda.bench.gguf_files llama-3.1-8b "$M/llama-3.1-8b-q4_k_m.gguf" --type Q4_K_M

$PY benchmarks/compare.py run --model "$M/llama-3.2-1b-q4_k_m.gguf" --engines pagoda,pagoda-gguf,llama-server \
  --threads 2 --concurrency 1,16 --num-prompts 4,16 --input-len 128 --output-len 64 --out-dir "$OUT/real-1b-s2"
$PY benchmarks/compare.py table "$OUT/real-1b-s2"

$PY benchmarks/compare.py run --model "$M/llama-3.1-8b-q4_k_m.gguf" --engines pagoda,pagoda-gguf,llama-server \
  --threads 2 --concurrency 1 --num-prompts 2 --input-len 128 --output-len 32 --out-dir "$OUT/real-8b-s2"
$PY benchmarks/compare.py table "$OUT/real-8b-s2"

# The 8B file at 16 streams (seventh pass): ~2.5 minutes for pagoda, ~5 for llama-server here.
$PY benchmarks/compare.py run --model "$M/llama-3.1-8b-q4_k_m.gguf" --engines pagoda-gguf,llama-server \
  --threads 2 --concurrency 16 --num-prompts 16 --input-len 128 --output-len 32 --out-dir "$OUT/real-8b-c16"
$PY benchmarks/compare.py table "$OUT/real-8b-c16"
