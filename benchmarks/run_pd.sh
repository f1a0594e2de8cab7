#!/usr/bin/env bash
# Prefill-decode disaggregation against one colocated instance (issue #27; docs/parallel.md,
# "Prefill-decode disaggregation"): STREAMS streams decode (128-token prompts, STREAM_OUT tokens
# each, ignore_eos) while LONG_N prompts of LONG_IN tokens arrive at LONG_RATE per second.
#   colocated: one `pagoda serve`, both cores (taskset 0,1; 2 threads)
#   pd:        a prefill instance on core 0 and a decode instance on core 1 (1 thread each)
#              behind `pagoda router` (shared-memory transport: one host)
# The streams' ITL p99 and TPOT say what long prompts cost the decoding requests; the long
# prompts' TTFT what the transfer and the smaller prefill instance cost them. Results:
# $OUT/{colocated,pd}-{streams,prompts}.json and a table on stdout. Needs a quiet machine (the
# clients and the router share the cores). SMOKE=1: a tiny run that only checks the script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/results/pd}
STREAMS=${STREAMS:-16}; STREAM_OUT=${STREAM_OUT:-256}
LONG_IN=${LONG_IN:-2048}; LONG_N=${LONG_N:-8}; LONG_RATE=${LONG_RATE:-0.1}
if [[ "${SMOKE:-0}" == 1 ]]; then STREAMS=2; STREAM_OUT=8; LONG_IN=200; LONG_N=1; LONG_RATE=1; fi
PORT=${PORT:-8300}
SERVE=(-m pagoda.entrypoints.cli serve --max-model-len $((LONG_IN + 512)) --disable-log-requests --disable-log-stats)
BENCH=(-m pagoda.entrypoints.cli bench serve --ignore-eos --no-progress --num-warmups 0)
mkdir -p "$OUT"

pids=()
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap stop_all EXIT
wait_up() {
  for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done
  echo "$1 did not come up" >&2; exit 1
}

workload() {  # $1: base url, $2: label
  $PY "${BENCH[@]}" --base-url "$1" --input-len 128 --output-len "$STREAM_OUT" --num-prompts $((STREAMS * 2)) \
    --max-concurrency "$STREAMS" --label "$2-streams" --save-result "$OUT/$2-streams.json" &
  local streams=$!
  sleep 5   # the streams are decoding before the first long prompt comes
  $PY "${BENCH[@]}" --base-url "$1" --input-len "$LONG_IN" --output-len 16 --num-prompts "$LONG_N" \
    --request-rate "$LONG_RATE" --label "$2-prompts" --save-result "$OUT/$2-prompts.json"
  wait "$streams"
}

# 1. Colocated.
taskset -c 0,1 $PY "${SERVE[@]}" --num-threads 2 --port "$PORT" & pids+=($!)
wait_up "http://127.0.0.1:$PORT"
workload "http://127.0.0.1:$PORT" colocated
stop_all

# 2. Disaggregated.
taskset -c 0 $PY "${SERVE[@]}" --num-threads 1 --port $((PORT + 1)) --kv-role prefill & pids+=($!)
taskset -c 1 $PY "${SERVE[@]}" --num-threads 1 --port $((PORT + 2)) --kv-role decode & pids+=($!)
wait_up "http://127.0.0.1:$((PORT + 1))"; wait_up "http://127.0.0.1:$((PORT + 2))"
$PY -m pagoda.entrypoints.cli router --prefill "http://127.0.0.1:$((PORT + 1))" \
  --decode "http://127.0.0.1:$((PORT + 2))" --port $((PORT + 3)) & pids+=($!)
wait_up "http://127.0.0.1:$((PORT + 3))"
workload "http://127.0.0.1:$((PORT + 3))" pd
stop_all

$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
print("| setting | streams: ITL p50 / p99 ms | streams: TPOT p50 / p99 ms | streams out tok/s | long prompts: TTFT p50 / p99 ms |")
print("|---|---|---|---|---|")
for label in ("colocated", "pd"):
    s = json.load(open(f"{out}/{label}-streams.json"))["points"][0]["metrics"]
    p = json.load(open(f"{out}/{label}-prompts.json"))["points"][0]["metrics"]
    print(f"| {label} | {s['itl_ms']['median']:.1f} / {s['itl_ms']['p99']:.1f} | {s['tpot_ms']['median']:.1f} / "
          f"{s['tpot_ms']['p99']:.1f} | {s['output_throughput']:.1f} | {p['ttft_ms']['median']:.0f} / {p['ttft_ms']['p99']:.0f} |")
PYEOF
