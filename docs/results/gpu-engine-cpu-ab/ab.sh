#!/bin/bash
# A/B: base (b3df486, /tmp/base) vs new (/work/main), offline bench latency, alternated.
PY=/work/main/.venv/bin/python
for round in 1 2; do
  for tree in /tmp/base /work/main; do
    for spec in "default 1" "default 16" "/tmp/llama1b-q4km.gguf 1" "/tmp/llama1b-q4km.gguf 16"; do
      set -- $spec
      model=$1; b=$2
      margs=""; [ "$model" != default ] && margs="--model $model"
      out=$(cd $tree && PYTHONPATH=$tree $PY -m pagoda.entrypoints.cli bench latency $margs --batch-size $b --input-len 128 --output-len 32 --num-iters 3 --num-iters-warmup 1 2>&1 | grep "decode step  median")
      echo "round $round $(basename $tree) $(basename $model) b$b: $out"
    done
  done
done
