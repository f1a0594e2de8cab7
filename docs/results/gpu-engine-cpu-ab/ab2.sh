#!/bin/bash
PY=/work/main/.venv/bin/python
for round in 1 2 3; do
  for tree in /tmp/base /work/main; do
    for b in 1 16; do
      out=$(cd $tree && PYTHONPATH=$tree $PY -m pagoda.entrypoints.cli bench latency --batch-size $b --input-len 128 --output-len 64 --num-iters 3 --num-iters-warmup 1 2>&1 | grep "decode step  median")
      echo "round $round $(basename $tree) default b$b: $out"
    done
  done
done
