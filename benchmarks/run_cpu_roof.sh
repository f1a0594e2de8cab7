#!/usr/bin/env bash
# The commands behind docs/benchmarks.md's "CPU roof" section (issue #28): the bundled model
# offline against OpenVINO GenAI (fp32 IR in f32, fp32 IR at its defaults = bf16 where the
# CPU has bf16 units, int8 and int4 weight-compressed IRs), served against llama-server at
# its best thread count here (-t 2), and pagoda's thread policy (its governor against one
# and two fixed threads). 128-token prompts, 128 output tokens, greedy, ignore_eos.
# OUT=DIR puts the results under DIR (docs/results by default; an AMX machine's: docs/results/amx).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-docs/results}
grep -o -w -E 'avx512_bf16|avx512_vnni|amx_bf16|amx_int8|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo

$PY benchmarks/compare.py install openvino        # its own venv + the model's IRs; a no-op once done
$PY benchmarks/compare.py install llama-server    # a no-op once built

$PY benchmarks/compare.py run --engines pagoda-offline,pagoda-int8-offline,pagoda-bf16-offline,openvino-fp32-f32,openvino-fp32,openvino-int8,openvino-int4 \
  --concurrency 1,16,64 --num-prompts 4,16,64 --input-len 128 --output-len 128 --out-dir "$OUT/cpu-roof-offline"
$PY benchmarks/compare.py run --engines pagoda-q4-offline,pagoda-int8-offline,openvino-int8,openvino-int4 \
  --concurrency 1,16,64 --num-prompts 4,16,64 --input-len 128 --output-len 128 --out-dir "$OUT/cpu-roof-offline-2"
$PY benchmarks/compare.py run --engines pagoda-int8,pagoda-q4,pagoda,llama-server --threads 2 \
  --concurrency 1,16,64 --num-prompts 4,16,64 --input-len 128 --output-len 128 --out-dir "$OUT/cpu-roof-served"
for t in gov 1 2; do
  [ "$t" = gov ] && A=() || A=(--pagoda-threads "$t")
  $PY benchmarks/compare.py run --engines pagoda-int8,pagoda --concurrency 1,16,64 --num-prompts 4,16,64 \
    --input-len 128 --output-len 128 "${A[@]}" --out-dir "$OUT/cpu-roof-threads-$t"
done

# The 1B-shaped Q4_K_M file of issue #20 (made as in run_real_models.sh), against OpenVINO's
# IRs exported from the same weights (transformers dequantizes the GGUF to an fp32 HF folder)
# and llama-server.
M=${MODELS:-/tmp/models}
mkdir -p "$M"
QUANTIZE=$(dirname "$($PY -c 'import sys; sys.path.insert(0, "benchmarks"); import peers; print(peers.llama_server_binary(peers.DEFAULT_CACHE))')")/llama-quantize
[ -f "$M/llama-3.2-1b-f16.gguf" ] || $PY -m pagoda.bench.gguf_files llama-3.2-1b "$M/llama-3.2-1b-f16.gguf" --type F16
[ -f "$M/llama-3.2-1b-q4_k_m.gguf" ] || "$QUANTIZE" "$M/llama-3.2-1b-f16.gguf" "$M/llama-3.2-1b-q4_k_m.gguf" Q4_K_M 2
$PY benchmarks/compare.py run --model "$M/llama-3.2-1b-q4_k_m.gguf" --threads 2 \
  --engines pagoda-gguf-offline,pagoda-int8-offline,openvino-int4,openvino-int8,openvino-fp32,pagoda-gguf,llama-server \
  --concurrency 1,16 --num-prompts 2,16 --input-len 128 --output-len 64 --out-dir "$OUT/cpu-roof-1b"
