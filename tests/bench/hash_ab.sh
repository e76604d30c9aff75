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
# A second table gives the server's CPU time per batch (user + system, /proc/PID/stat: on a
# shared machine steadier than rows/s), medians, and the same ratios taken from it (dense CPU
# per batch over hash CPU per batch: what rows/s would be, were the server CPU-bound).
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
# For table $1 so far: the distinct rows per batch summed, the push batches, and the lookups
# and pushes the server ran (its own counts, warmup included, as its CPU time is).
unique() {
  /usr/bin/python3 - "$mport" "$1" <<'PY'
import sys, urllib.request
port, table = sys.argv[1:]
text = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port, timeout=10).read().decode()
v = {}
for line in text.splitlines():
    for k in ("unique_tokens_per_batch_sum", "unique_tokens_per_batch_count", "lookups_total",
              "pushes_total"):
        if line.startswith('embps_table_%s{table="%s"}' % (k, table)):
            v[k] = int(float(line.split()[-1]))
print(v.get("unique_tokens_per_batch_sum", 0), v.get("unique_tokens_per_batch_count", 0),
      v.get("lookups_total", 0) + v.get("pushes_total", 0))
PY
}
# Prints rows/s (and, for a push, distinct rows per batch) of one run.
rate() { # TABLE BATCH PUSH_RATIO DIST [FLAGS...]
  local k=lookup_rows_per_s u0 u1
  [ "$3" = 1 ] && k=push_rows_per_s
  u0=$(unique "$1")
  c0=$(awk '{print $14 + $15}' /proc/$SP/stat)
  $E bench "$1" --batch "$2" --duration "$D" --push-ratio "$3" --tokens "$4" "${@:5}" --json |
    /usr/bin/python3 -c "import json,sys; print(int(json.load(sys.stdin)['$k']), end=' ')"
  c1=$(awk '{print $14 + $15}' /proc/$SP/stat)
  u1=$(unique "$1")
  echo "$u0 $u1 $c0 $c1 $(getconf CLK_TCK)" | /usr/bin/python3 -c "
import sys
a = list(map(float, sys.stdin.read().split()))
print(round((a[3] - a[0]) / max(1, a[4] - a[1])), end=' ')  # distinct rows per push batch
print('%.3f' % ((a[7] - a[6]) * 1000 / a[8] / max(1, a[5] - a[2])))  # CPU ms per batch"
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
        runs+=("dense=$(rate dense "$batch" "$op" "$dist" | tr ' ' :)") # rows/s:distinct:cpu
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
c = {}
for run in sys.argv[5:]:
    name, v = run.split("=")
    rate, uniq, cpu = v.split(":")
    r.setdefault(name, []).append(int(rate))
    u.setdefault(name, []).append(int(uniq))
    c.setdefault(name, []).append(float(cpu))
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
cm = {k: statistics.median(v) for k, v in c.items()}
line = "%-7s %-6s %6s  cpu ms/batch: dense %.2f hash %.2f" % (dist, "", batch, cm["dense"], cm["hash"])
line += "  hash/dense %.2f" % (cm["dense"] / cm["hash"])
if equal == "1":
    line += "  d10R %.2f hash/d10R %.2f  hin %.2f hin/dense %.2f" % (
        cm["d10R"], cm["d10R"] / cm["hash"], cm["hin"], cm["dense"] / cm["hin"])
print(line, flush=True)
PY
    done
  done
done
$E stats | grep "table h"
