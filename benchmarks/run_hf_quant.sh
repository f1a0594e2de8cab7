#!/usr/bin/env bash
# The commands behind docs/benchmarks.md's "Pre-quantized HF checkpoints (issue #26)": a
# Llama-3.2-1B-shaped checkpoint as GPTQ (4 bits, groups of 128), AWQ (GEMM, 4 bits, groups
# of 128) and FP8 (e4m3, 128 x 128 blocks) folders and as Q4_K_M / Q8_0 GGUF files, random
# weights of the same shape and seed with the bundled tokenizer; pagoda on every one (exact
# mode, and the gguf mode where the format has one: not FP8), llama-server -t 2 on the GGUF
# files. 128-token prompts, 64 output tokens, greedy, ignore_eos; c=1 four prompts, c=16 sixteen.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=docs/results
M=${MODELS:-/tmp/models/qbench}
mkdir -p "$M"
grep -o -w -E 'avx512_bf16|avx512_vnni|amx_bf16|amx_int8|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo

$PY benchmarks/compare.py install llama-server    # a no-op once built
for f in gptq awq fp8; do
  [ -f "$M/llama-3.2-1b-$f/config.json" ] || $PY -m pagoda.bench.hf_quant_files llama-3.2-1b "$M/llama-3.2-1b-$f" --format $f --seed 0
done
for t in Q4_K_M Q8_0; do
  lower=$(echo $t | tr 'A-Z' 'a-z')
  [ -f "$M/llama-3.2-1b-$lower.gguf" ] || $PY -m pagoda.bench.gguf_files llama-3.2-1b "$M/llama-3.2-1b-$lower.gguf" --type $t --seed 0
done
COMMON=(--threads 2 --concurrency 1,16 --num-prompts 4,16 --input-len 128 --output-len 64)
for f in gptq awq; do
  $PY benchmarks/compare.py run --model "$M/llama-3.2-1b-$f" --engines pagoda,pagoda-gguf "${COMMON[@]}" \
    --out-dir "$OUT/hfq-1b-$f"
done
# FP8 has no gguf mode (pagoda refuses --quantization gguf for it): the exact mode alone.
$PY benchmarks/compare.py run --model "$M/llama-3.2-1b-fp8" --engines pagoda "${COMMON[@]}" --out-dir "$OUT/hfq-1b-fp8"
for t in q4_k_m q8_0; do
  $PY benchmarks/compare.py run --model "$M/llama-3.2-1b-$t.gguf" --engines pagoda,pagoda-gguf,llama-server \
    "${COMMON[@]}" --out-dir "$OUT/hfq-1b-$t"
done
