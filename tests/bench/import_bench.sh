#!/usr/bin/env bash
# Import against push (issue 33's closing note): `embps import` of a ROWS x WIDTH f32 .npy into a
# table of that shape on an N-rank loopback group, timed REPEAT times, then `embps bench` pushing
# batches of the same rows (16384, about what import sends per assign at width 128) with two in
# flight, as import keeps two. Prints rows/s of each and their ratio (the target: import at
# least half of push). A sample of the imported rows is checked against the file first.
#
#   tests/bench/import_bench.sh [--ranks N] [--rows R] [--width W] [--repeat K] [--duration S]
#
# Needs build/bin/embps-server, build/bin/embps and /usr/bin/python3 with numpy (the file is
# written to a temporary directory and removed).
set -euo pipefail
cd "$(dirname "$0")/../.."
ranks=1 rows=1000000 width=128 repeat=3 duration=8
while [ $# -gt 0 ]; do
  case $1 in
    --ranks) ranks=$2; shift 2 ;;
    --rows) rows=$2; shift 2 ;;
    --width) width=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
E=$PWD/build/bin/embps S=$PWD/build/bin/embps-server
dir=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait || true; rm -rf "$dir"; }
trap cleanup EXIT
/usr/bin/python3 -c "
import numpy as np
a = np.random.default_rng(0).standard_normal(($rows, $width), dtype=np.float32)
a[0] = 0
np.save('$dir/rows.npy', a)"
base=$((20000 + RANDOM % 20000))
peers=""
for r in $(seq 0 $((ranks - 1))); do peers="$peers${peers:+,}127.0.0.1:$((base + r))"; done
for r in $(seq 0 $((ranks - 1))); do
  "$S" --rank "$r" --peers "$peers" --peer-port-offset 7 > "$dir/rank$r.log" 2>&1 &
  pids+=($!)
done
export EMBPS_SERVERS=$peers
for _ in $(seq 1 100); do "$E" health > /dev/null 2>&1 && break; sleep 0.1; done
"$E" create-table t --rows "$rows" --emb-width "$width" --optimizer rowwise_adagrad > /dev/null
best=""
for _ in $(seq 1 "$repeat"); do
  t0=$(date +%s.%N)
  "$E" import t "$dir/rows.npy" --no-progress > /dev/null
  t1=$(date +%s.%N)
  s=$(echo "$t1 - $t0" | bc -l)
  echo "import: $rows rows in $s s"
  if [ -z "$best" ] || [ "$(echo "$s < $best" | bc -l)" = 1 ]; then best=$s; fi
done
PYTHONPATH=python EMBPS_CACHE_DIR="$dir/cache" /usr/bin/python3 -c "
import embps, numpy as np
a = np.load('$dir/rows.npy', mmap_mode='r')
t = np.random.default_rng(3).integers(1, $rows, 8192 - 8192 % $ranks)
assert np.array_equal(embps.Client().lookup('t', t), a[t]), 'imported rows differ'
print('a sample of 8192 imported rows equals the file bitwise')"
push=$("$E" bench t --batch 16384 --push-ratio 1 --duration "$duration" --warmup 1 --pipeline 2 \
  --output json | /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin)['push_rows_per_s'])")
imp=$(echo "$rows / $best" | bc -l)
printf "ranks %d, %d x %d f32: import %.0f rows/s (best of %d), push %.0f rows/s, import/push %.2f\n" \
  "$ranks" "$rows" "$width" "$imp" "$repeat" "$push" "$(echo "$imp / $push" | bc -l)"
