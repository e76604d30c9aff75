#!/usr/bin/env bash
# Interleaved A/B of push throughput with and without --push-overlap-bytes (a push deduplicated
# and summed while its gradients arrive, server/service/push_prep.h), on one build: two servers,
# one with the overlap off, each with its own 1M x 128 f32 rowwise Adagrad table; every round
# measures, on each server in turn, a push and a lookup at 4096 and 65536 uniform tokens, one
# call in flight, so the push/lookup ratio of issue 13 comes from the same minutes.
#
#   tests/bench/push_ab.sh [ROUNDS [SECONDS]]      (default 3 rounds of 4 s)
# Prints one line per measurement (rows/s, p50, p99) and the medians per case at the end.
set -u
cd "$(dirname "$0")/../.."
rounds=${1:-3}
dur=${2:-4}
cmake --build build -j "$(nproc)" --target embps-server embps >/dev/null || exit 1
work=$(mktemp -d /tmp/embps-push-ab.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
declare -A addr
for v in off on; do
  flag=()
  [ "$v" = off ] && flag=(--push-overlap-bytes 0)
  build/bin/embps-server --listen 127.0.0.1:0 "${flag[@]}" >"$work/$v.log" 2>&1 &
  pids+=($!)
  a=
  for _ in $(seq 100); do
    a=$(grep -o 'listening on [0-9.]*:[0-9]*' "$work/$v.log" | awk '{print $3}') && [ -n "$a" ] && break
    sleep 0.1
  done
  [ -n "$a" ] || { cat "$work/$v.log"; echo "$v: the server did not start" >&2; exit 1; }
  addr[$v]=$a
  build/bin/embps --servers "$a" create-table bench --rows 1000000 --emb-width 128 --dtype f32 \
    --optimizer rowwise_adagrad >/dev/null || exit 1
done
for r in $(seq "$rounds"); do
  for batch in 4096 65536; do
    for v in off on; do
      for ratio in 1 0; do
        op=push; [ "$ratio" = 0 ] && op=lookup
        out=$(build/bin/embps --servers "${addr[$v]}" bench bench --batch "$batch" \
              --duration "$dur" --warmup 1 --push-ratio "$ratio" --json) || exit 1
        echo "round $r overlap=$v $op batch=$batch $(/usr/bin/python3 -c 'import json,sys; d=json.load(sys.stdin); op=sys.argv[1]; print("%.0f rows/s p50 %.3f ms p99 %.3f ms" % (d[op + "_rows_per_s"], d["p50_ms"], d["p99_ms"]))' "$op" <<<"$out")"
      done
    done
  done
done | tee "$work/lines"
echo "medians:"
/usr/bin/python3 - "$work/lines" <<'PY'
import re, statistics, sys
cases = {}
for line in open(sys.argv[1]):
    m = re.match(r"round \d+ overlap=(\w+) (\w+) batch=(\d+) (\d+) rows/s p50 ([\d.]+) ms", line)
    if m:
        cases.setdefault((m[1], m[2], int(m[3])), []).append((float(m[4]), float(m[5])))
for batch in (4096, 65536):
    for v in ("off", "on"):
        push = cases.get((v, "push", batch), [])
        look = cases.get((v, "lookup", batch), [])
        if not push or not look:
            continue
        pr = statistics.median(x[0] for x in push)
        lr = statistics.median(x[0] for x in look)
        print("batch %6d overlap %-3s push %9.0f rows/s (p50 %.3f ms)  lookup %9.0f rows/s  push/lookup %.2fx"
              % (batch, v, pr, statistics.median(x[1] for x in push), lr, pr / lr))
PY
