#!/usr/bin/env bash
# Issue #50's speed figures: a SmolVLM-256M-shaped Idefics3 checkpoint (random weights) as
# llama.cpp's GGUF + mmproj pair (its own converter: Q8_0 text, F16 projector), one 384x384
# image (17 tiles of 64 tokens: 1,088 image tokens) and 64 tokens out per request, served by
# pagoda (its int8 mode: tower and language model in int8; its default mode for the file) and
# by llama-server -t 2 --mmproj in the same run, at 1 and 8 streams (-np 8). One server at a
# time; keep the machine quiet. ENGINES picks the engines, ROUNDS=3 measures each three times
# per point (engines alternating) and keeps the median, OUT another results folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-docs/results/vision}
M=${MODELS:-/tmp/models/smolvlm}
$PY benchmarks/compare.py install llama-server     # a no-op once built
$PY benchmarks/smolvlm_pair.py "$M"
$PY benchmarks/compare.py run --model "$M/smolvlm-256m-q8_0.gguf" --mmproj "$M/mmproj-smolvlm-256m-f16.gguf" \
  --image-size 384x384 --images-per-request 1 --image-tokens 1200 \
  --engines ${ENGINES:-pagoda-int8,pagoda,llama-server} --rounds ${ROUNDS:-1} --threads 2 \
  --concurrency 1,8 --num-prompts 4,8 --input-len 32 --output-len 64 --out-dir "$OUT"
$PY benchmarks/compare.py table "$OUT"
