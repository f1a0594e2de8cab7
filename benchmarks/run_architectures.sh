#!/usr/bin/env bash
# The commands behind docs/benchmarks.md's "The architectures people run (issue #21)": a
# Qwen3-1.7B-shaped dense file and a Qwen3-MoE-shaped file (Qwen3-30B-A3B's structure at
# 1.6B parameters, 0.34B active), random weights written directly in llama.cpp's Q4_K_M mix
# with the bundled tokenizer, served by pagoda (gguf and int8 modes) and llama-server at its
# best thread count here (-t 2). 128-token prompts, 64 output tokens, greedy, ignore_eos.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=docs/results
M=${MODELS:-/tmp/models}
mkdir -p "$M"
grep -o -w -E 'avx512_bf16|avx512_vnni|amx_bf16|amx_int8|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo

$PY benchmarks/compare.py install llama-server    # a no-op once built
for shape in qwen3-1.7b qwen3-moe-1.6b-a0.3b; do
  [ -f "$M/$shape-q4_k_m.gguf" ] || $PY -m pagoda.bench.gguf_files "$shape" "$M/$shape-q4_k_m.gguf" --type Q4_K_M
done
$PY benchmarks/compare.py run --model "$M/qwen3-1.7b-q4_k_m.gguf" --threads 2 \
  --engines pagoda-gguf,pagoda-int8,llama-server --concurrency 1,16 --num-prompts 2,16 \
  --input-len 128 --output-len 64 --out-dir "$OUT/qwen3-1.7b"
$PY benchmarks/compare.py run --model "$M/qwen3-moe-1.6b-a0.3b-q4_k_m.gguf" --threads 2 \
  --engines pagoda-gguf,pagoda-int8,llama-server --concurrency 1,16 --num-prompts 2,16 \
  --input-len 128 --output-len 64 --out-dir "$OUT/qwen3-moe"
# GPT-OSS-20B's structure (24 layers, 64 query / 8 KV heads of 64, sinks, biases, a window of
# 128 on even layers, YaRN; top-4 of 32 experts of 2880) as llama.cpp's files hold it: experts
# in MXFP4, the rest float16 (12.0 GB). pagoda exact and gguf modes against llama-server -t 2.
[ -f "$M/gpt-oss-20b-mxfp4.gguf" ] || $PY -m pagoda.bench.gguf_files gpt-oss-20b "$M/gpt-oss-20b-mxfp4.gguf" --type MXFP4
$PY benchmarks/compare.py run --model "$M/gpt-oss-20b-mxfp4.gguf" --threads 2 \
  --engines pagoda,pagoda-gguf,llama-server --concurrency 1,16 --num-prompts 2,16 \
  --input-len 128 --output-len 64 --out-dir "$OUT/gpt-oss-20b"
