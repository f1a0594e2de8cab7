#!/usr/bin/env bash
# The commands behind docs/parallel.md's "Benchmark" (issue #27): TP=2, PP=2 and DP=2 against
# one process (TP=1: both cores, its thread governor) at c=16 on the bundled model and on the
# Llama-3.2-1B-shaped Q4_K_M file (gguf mode), and EP=2 against TP=2 on a Qwen3-MoE-shaped
# Q4_K_M file (gguf mode), and DP=2 with the experts split over the replicas. 16 prompts of 128 random tokens sent at once, 64 output tokens
# each, greedy, ignore_eos; one thread per rank or replica. Results: $OUT/*.json and stdout.
# Needs a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/results/parallel-2}
M=${MODELS:-/tmp/models/qbench}
mkdir -p "$OUT" "$M"
grep -m1 "model name" /proc/cpuinfo; grep -o -w -E 'avx512_bf16|avx512_vnni|amx_bf16|amx_int8|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
[ -f "$M/llama-3.2-1b-q4_k_m.gguf" ] || $PY -m pagoda.bench.gguf_files llama-3.2-1b "$M/llama-3.2-1b-q4_k_m.gguf" --type Q4_K_M --seed 0
[ -f "$M/qwen3-moe-1.6b-a0.3b.gguf" ] || $PY -m pagoda.bench.gguf_files qwen3-moe-1.6b-a0.3b "$M/qwen3-moe-1.6b-a0.3b.gguf" --type Q4_K_M --seed 0
W=(--num-prompts 16 --input-len 128 --output-len 64)
$PY -m pagoda.entrypoints.cli bench parallel --settings tp1,tp2,pp2,dp2 "${W[@]}" --save-result "$OUT/bundled.json"
$PY -m pagoda.entrypoints.cli bench parallel --model "$M/llama-3.2-1b-q4_k_m.gguf" --quantization gguf \
  --settings tp1,tp2,pp2,dp2 "${W[@]}" --save-result "$OUT/llama-1b-q4_k_m-gguf.json"
$PY -m pagoda.entrypoints.cli bench parallel --model "$M/qwen3-moe-1.6b-a0.3b.gguf" --quantization gguf \
  --settings tp1,tp2,tp2ep "${W[@]}" --save-result "$OUT/qwen3-moe-gguf.json"
$PY -m pagoda.entrypoints.cli bench parallel --model "$M/qwen3-moe-1.6b-a0.3b.gguf" --quantization gguf \
  --settings dp2,dp2ep "${W[@]}" --save-result "$OUT/qwen3-moe-gguf-dp.json"
