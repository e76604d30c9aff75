#!/usr/bin/env bash
# Hash-keyed against dense on one server (issue 31's closing note): a dense table of R rows and a
# hash-keyed table of capacity R (128-wide f32, rowwise Adagrad), the hash table first filled by
# pushes over a key space of 10 x R so that every later push evicts; then lookups and pushes of
# 4096 and 65536 tokens, uniform and Zipf, each run on the dense table and then on the hash table
# (interleaved), REPEAT times; prints every run's rows/s and the ratio of the medians. A quicker,
# narrower cut of tests/bench/run.sh's hash section.
#
#   tests/bench/hash_ab.sh [--rows R] [--duration S] [--repeat K] [--bin DIR]
#
# --bin: where embps-server and embps are (default build/bin); copy them elsewhere first when a
# build may replace them during the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=100000
D=2
REP=3
B=build/bin
while [ $# -gt 0 ]; do
  case $1 in
    --rows) R=$2; shift 2 ;;
    --duration) D=$2; shift 2 ;;
    --repeat) REP=$2; shift 2 ;;
    --bin) B=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
port=$((20000 + RANDOM % 20000))
log=$(mktemp)
"$B/embps-server" --listen 127.0.0.1:$port >"$log" 2>&1 &
SP=$!
trap 'kill $SP 2>/dev/null; wait $SP 2>/dev/null; rm -f "$log"' EXIT
E="$B/embps --servers 127.0.0.1:$port"
for _ in $(seq 50); do $E tables >/dev/null 2>&1 && break; sleep 0.1; done
$E create-table dense --rows "$R" --emb-width 128 --optimizer rowwise_adagrad >/dev/null
$E create-table hash --capacity "$R" --emb-width 128 --optimizer rowwise_adagrad >/dev/null
for _ in 1 2 3 4 5 6; do
  $E bench hash --batch 65536 --duration 1 --push-ratio 1 --key-space $((10 * R)) --json >/dev/null
done
rate() { # TABLE BATCH PUSH_RATIO DIST [FLAGS...]
  local k=lookup_rows_per_s
  [ "$3" = 1 ] && k=push_rows_per_s
  $E bench "$1" --batch "$2" --duration "$D" --push-ratio "$3" --tokens "$4" "${@:5}" --json |
    /usr/bin/python3 -c "import json,sys; print(int(json.load(sys.stdin)['$k']))"
}
printf "%-8s %-7s %6s  %-32s %-32s %s\n" dist op batch "dense rows/s" "hash rows/s" "hash/dense"
for dist in uniform zipf; do
  for op in 0 1; do
    for batch in 4096 65536; do
      ds=() hs=()
      for _ in $(seq "$REP"); do
        ds+=("$(rate dense "$batch" "$op" "$dist")")
        hs+=("$(rate hash "$batch" "$op" "$dist" --key-space $((10 * R)))")
      done
      /usr/bin/python3 - "$dist" "$op" "$batch" "${ds[*]}" "${hs[*]}" <<'PY'
import statistics, sys
dist, op, batch, ds, hs = sys.argv[1:]
d = [int(x) for x in ds.split()]
h = [int(x) for x in hs.split()]
print("%-8s %-7s %6s  %-32s %-32s %.2f" % (dist, "push" if op == "1" else "lookup", batch,
      " ".join(map(str, d)), " ".join(map(str, h)), statistics.median(h) / statistics.median(d)))
PY
    done
  done
done
$E stats | grep "table hash"
