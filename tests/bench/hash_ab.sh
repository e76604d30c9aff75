#!/usr/bin/env bash
# Hash-keyed against dense on one server (issue 31's closing note): a dense table of R rows and a
# hash-keyed table of capacity R (128-wide f32, rowwise Adagrad), the hash table first filled by
# pushes over a key space of 10 x R so that every later push evicts; then lookups and pushes of
# 4096 and 65536 tokens, uniform and Zipf, each run on the dense table and then on the hash table
# (interleaved), REPEAT times; prints every run's rows/s and the ratio of the medians (the issue's
# comparison: "hash/dense"). A quicker, narrower cut of tests/bench/run.sh's hash section.
#
# The issue's comparison mixes two costs: the index's (finding keys, inserting and evicting,
# the initial rows of new keys) and the workload's (keys drawn over 10 x R have more distinct
# keys per batch than ids drawn over R rows: more rows to sum and update). Two more pairs, run in
# the same interleaved rounds, separate them, each at an equal number of distinct rows a batch:
#   hash/d10R  the same hash table against a dense table of 10 x R rows with ids over [1, 10 x R]
#              (the hash workload's distinct rows, with no index): the index's whole cost;
#   hin/dense  a second hash table of capacity R fed keys over R - 1 ranks (every key stored
#              after its warm-up: no new key, no eviction) against the dense table: the cost of
#              finding and touching stored keys.
# For pushes, the distinct rows per batch each table saw (the server's
# embps_table_unique_tokens_per_batch) follow, so the pairs can be checked to be equal.
#
#   tests/bench/hash_ab.sh [--rows R] [--duration S] [--repeat K] [--bin DIR] [--issue-only]
#
# --bin: where embps-server and embps are (default build/bin); copy them elsewhere first when a
# build may replace them during the run. --issue-only: the issue's pair alone (half the time).
set -euo pipefail
cd "$(dirname "$0")/../.."
R=100000
D=2
REP=3
B=build/bin
EQUAL=1
while [ $# -gt 0 ]; do
  case $1 in
    --rows) R=$2; shift 2 ;;
    --duration) D=$2; shift 2 ;;
    --repeat) REP=$2; shift 2 ;;
    --bin) B=$2; shift 2 ;;
    --issue-only) EQUAL=0; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
port=$((20000 + RANDOM % 20000))
mport=$((port + 1))
log=$(mktemp)
"$B/embps-server" --listen 127.0.0.1:$port --metrics-listen 127.0.0.1:$mport >"$log" 2>&1 &
SP=$!
trap 'kill $SP 2>/dev/null; wait $SP 2>/dev/null; rm -f "$log"' EXIT
E="$B/embps --servers 127.0.0.1:$port"
for _ in $(seq 50); do $E tables >/dev/null 2>&1 && break; sleep 0.1; done
$E create-table dense --rows "$R" --emb-width 128 --optimizer rowwise_adagrad >/dev/null
$E create-table hash --capacity "$R" --emb-width 128 --optimizer rowwise_adagrad >/dev/null
for _ in 1 2 3 4 5 6; do
  $E bench hash --batch 65536 --duration 1 --push-ratio 1 --key-space $((10 * R)) --json >/dev/null
done
if [ "$EQUAL" = 1 ]; then
  $E create-table d10R --rows $((10 * R + 1)) --emb-width 128 --optimizer rowwise_adagrad >/dev/null
  $E create-table hin --capacity "$R" --emb-width 128 --optimizer rowwise_adagrad >/dev/null
  for _ in 1 2 3; do
    $E bench hin --batch 65536 --duration 1 --push-ratio 1 --key-space $((R - 1)) --json >/dev/null
  done
fi
# The distinct rows per batch summed so far and the batches, for table $1.
unique() {
  /usr/bin/python3 - "$mport" "$1" <<'PY'
import sys, urllib.request
port, table = sys.argv[1:]
text = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port, timeout=10).read().decode()
v = {}
for line in text.splitlines():
    for k in ("sum", "count"):
        if line.startswith('embps_table_unique_tokens_per_batch_%s{table="%s"}' % (k, table)):
            v[k] = int(line.split()[-1])
print(v.get("sum", 0), v.get("count", 0))
PY
}
# Prints rows/s (and, for a push, distinct rows per batch) of one run.
rate() { # TABLE BATCH PUSH_RATIO DIST [FLAGS...]
  local k=lookup_rows_per_s u0 u1
  [ "$3" = 1 ] && k=push_rows_per_s
  u0=$(unique "$1")
  $E bench "$1" --batch "$2" --duration "$D" --push-ratio "$3" --tokens "$4" "${@:5}" --json |
    /usr/bin/python3 -c "import json,sys; print(int(json.load(sys.stdin)['$k']), end=' ')"
  u1=$(unique "$1")
  echo "$u0 $u1" | /usr/bin/python3 -c "import sys; a=list(map(int,sys.stdin.read().split())); print(round((a[2]-a[0])/max(1,a[3]-a[1])))"
}
if [ "$EQUAL" = 1 ]; then
  printf "%-7s %-6s %6s  %-30s %-30s %5s  %-30s %5s  %-30s %5s  %s\n" dist op batch "dense rows/s" \
    "hash rows/s" "hash/dense" "d10R rows/s" "hash/d10R" "hin rows/s" "hin/dense" \
    "distinct/batch: dense hash d10R hin"
else
  printf "%-7s %-6s %6s  %-30s %-30s %s\n" dist op batch "dense rows/s" "hash rows/s" "hash/dense"
fi
for dist in uniform zipf; do
  for op in 0 1; do
    for batch in 4096 65536; do
      runs=()
      for _ in $(seq "$REP"); do
        runs+=("dense=$(rate dense "$batch" "$op" "$dist" | tr ' ' :)")
        runs+=("hash=$(rate hash "$batch" "$op" "$dist" --key-space $((10 * R)) | tr ' ' :)")
        if [ "$EQUAL" = 1 ]; then
          runs+=("d10R=$(rate d10R "$batch" "$op" "$dist" --key-space $((10 * R)) | tr ' ' :)")
          runs+=("hin=$(rate hin "$batch" "$op" "$dist" --key-space $((R - 1)) | tr ' ' :)")
        fi
      done
      /usr/bin/python3 - "$dist" "$op" "$batch" "$EQUAL" "${runs[@]}" <<'PY'
import statistics, sys
dist, op, batch, equal = sys.argv[1:5]
r, u = {}, {}
for run in sys.argv[5:]:
    name, v = run.split("=")
    rate, uniq = v.split(":")
    r.setdefault(name, []).append(int(rate))
    u.setdefault(name, []).append(int(uniq))
med = {k: statistics.median(v) for k, v in r.items()}
col = lambda k: " ".join(map(str, r[k]))
line = "%-7s %-6s %6s  %-30s %-30s %5.2f" % (dist, "push" if op == "1" else "lookup", batch,
                                              col("dense"), col("hash"), med["hash"] / med["dense"])
if equal == "1":
    line += "  %-30s %5.2f  %-30s %5.2f" % (col("d10R"), med["hash"] / med["d10R"], col("hin"),
                                            med["hin"] / med["dense"])
    if op == "1":
        line += "  %d %d %d %d" % tuple(statistics.median(u[k]) for k in ("dense", "hash", "d10R", "hin"))
print(line, flush=True)
PY
    done
  done
done
$E stats | grep "table h"
