#!/usr/bin/env bash
# Issue #49's speed figures: a Llama 4 Scout-shaped and a Gemma 4 26B-A4B-shaped MoE GGUF at
# sizes this machine holds (random weights in llama.cpp's Q4_K_M mix, pagoda.bench.gguf_files):
# - llama4-scout-2b: 16 layers of top-1 of 16 experts plus a shared expert, chunked attention
#   with every fourth layer global (2.1B parameters, 0.4B active);
# - gemma4-moe-4b: 16 layers of top-8 of 64 experts beside a dense MLP, 256-wide heads with
#   512-wide ones (2 KV heads, values from keys) on the global layers (3.8B, 0.9B active);
# each served by pagoda (its default mode for the file, the gguf mode, and the int8 mode) and
# by llama-server -t 2 in the same run, 128 tokens in, 128 out, at 1 and 16 streams. One
# server at a time; keep the machine quiet. FAMILIES="llama4-scout-2b" runs one; ENGINES
# picks the engines, ROUNDS=3 measures each three times per point (the engines alternating)
# and keeps the median, OUT another results folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-docs/results}
M=${MODELS:-/tmp/models}
mkdir -p "$M"
$PY benchmarks/compare.py install llama-server     # a no-op once built
for shape in ${FAMILIES:-llama4-scout-2b gemma4-moe-4b}; do
  f="$M/$shape-q4_k_m.gguf"
  [ -f "$f" ] || $PY -m pagoda.bench.gguf_files "$shape" "$f" --type Q4_K_M
  $PY benchmarks/compare.py run --model "$f" --engines ${ENGINES:-pagoda,pagoda-int8,llama-server} \
    --rounds ${ROUNDS:-1} --threads 2 --concurrency 1,16 --num-prompts 4,16 --input-len 128 --output-len 128 --out-dir "$OUT/$shape"
  $PY benchmarks/compare.py table "$OUT/$shape"
done
