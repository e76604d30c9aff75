#!/usr/bin/env bash
# The loopback benchmark of issue 2, in one run:
#   1. single-stream loopback TCP bandwidth with iperf3 (the ceiling),
#   2. embps lookup and push throughput at batch 4096 x 128 f32 and 65536 x 128 f32
#      (rowwise Adagrad), one client stream,
#   3. Redis (Debian's redis-server) serving the same 512-byte rows with MGET of 4096 keys.
# Prints one table at the end. Repeats each measurement REPEAT times and quotes medians.
#
#   tests/bench/run.sh [--duration S] [--repeat N] [--rows R] [--perf]
# --perf also records a CPU profile of the server during a lookup run and prints its top entries.
set -euo pipefail
cd "$(dirname "$0")/../.."

duration=5
repeat=3
rows=1000000
perf=0
while [ $# -gt 0 ]; do
  case $1 in
    --duration) duration=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --rows) rows=$2; shift 2 ;;
    --perf) perf=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

deploy/packages.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)" --target embps-server embps >/dev/null

work=$(mktemp -d /tmp/embps-bench.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
jget() { /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }

# ---- 1. iperf3 --------------------------------------------------------------------------------
iport=$(free_port)
iperf3 -s -B 127.0.0.1 -p "$iport" >/dev/null 2>&1 &
pids+=($!)
sleep 0.5
iperf_gbs=()
for _ in $(seq "$repeat"); do
  bps=$(iperf3 -c 127.0.0.1 -p "$iport" -t "$duration" -J | \
        /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"])')
  iperf_gbs+=("$(awk -v b="$bps" 'BEGIN{printf "%.3f", b/8/1e9}')")
done
iperf=$(printf '%s\n' "${iperf_gbs[@]}" | median)
echo "iperf3 single stream: ${iperf_gbs[*]} GB/s (median $iperf)"

# ---- 2. embps ---------------------------------------------------------------------------------
build/bin/embps-server --listen 127.0.0.1:0 >"$work/server.log" 2>&1 &
spid=$!
pids+=($spid)
for _ in $(seq 100); do
  addr=$(grep -o 'listening on [0-9.]*:[0-9]*' "$work/server.log" | awk '{print $3}') && [ -n "$addr" ] && break
  sleep 0.1
done
E="build/bin/embps --servers $addr"
$E create-table bench --rows "$rows" --emb-width 128 --dtype f32 --optimizer rowwise_adagrad >/dev/null

declare -A result
run_embps() { # KEY BATCH PUSH_RATIO FIELD
  local vals=()
  for _ in $(seq "$repeat"); do
    vals+=("$($E bench bench --batch "$2" --duration "$duration" --concurrency 1 --zipf 1.05 \
               --push-ratio "$3" --warmup 1 --json | jget "$4")")
  done
  result[$1]=$(printf '%s\n' "${vals[@]}" | median)
  echo "embps $1: ${vals[*]} (median ${result[$1]})"
}
run_embps lookup4096_rows 4096 0 lookup_rows_per_s
run_embps lookup4096_gbs 4096 0 lookup_gbytes_per_s
run_embps lookup4096_p50 4096 0 p50_ms
run_embps push4096_rows 4096 1 push_rows_per_s
run_embps push4096_p50 4096 1 p50_ms
run_embps lookup65536_rows 65536 0 lookup_rows_per_s
run_embps lookup65536_gbs 65536 0 lookup_gbytes_per_s
run_embps push65536_rows 65536 1 push_rows_per_s

if [ "$perf" = 1 ] && command -v perf >/dev/null; then
  ( $E bench bench --batch 4096 --duration "$duration" --concurrency 1 --push-ratio 0.5 --json >/dev/null ) &
  bpid=$!
  perf record -g -o "$work/perf.data" -p "$spid" -- sleep "$((duration > 2 ? duration - 1 : 1))" >/dev/null 2>&1 || true
  wait $bpid || true
  echo "---- server profile (lookup+push 4096 x 128) ----"
  perf report -i "$work/perf.data" --no-children --percent-limit 2 --stdio 2>/dev/null | grep -E '^ +[0-9]' | head -15 || true
fi

# ---- 3. Redis MGET ----------------------------------------------------------------------------
rport=$(free_port)
redis-server --port "$rport" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
  --io-threads 1 >"$work/redis.log" 2>&1 &
pids+=($!)
for _ in $(seq 50); do redis-cli -p "$rport" ping >/dev/null 2>&1 && break; sleep 0.1; done
rrows=100000
/usr/bin/python3 - "$rrows" >"$work/load.resp" <<'PY'
import sys
n = int(sys.argv[1]); v = b"x" * 512; out = sys.stdout.buffer
for i in range(n):
    k = b"key:%012d" % i
    out.write(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$512\r\n%s\r\n" % (len(k), k, v))
PY
redis-cli -p "$rport" --pipe <"$work/load.resp" >/dev/null
keys=()
for _ in $(seq 4096); do keys+=("key:__rand_int__"); done
redis_rows=()
for _ in $(seq "$repeat"); do
  rps=$(redis-benchmark -p "$rport" -c 1 -n 400 -r "$rrows" --csv MGET "${keys[@]}" | tail -1 | cut -d, -f2 | tr -d '"')
  redis_rows+=("$(awk -v r="$rps" 'BEGIN{printf "%.0f", r*4096}')")
done
redis=$(printf '%s\n' "${redis_rows[@]}" | median)
echo "redis MGET 4096 x 512 B: ${redis_rows[*]} rows/s (median $redis)"

# ---- the table ---------------------------------------------------------------------------------
lk=${result[lookup4096_rows]}; lg=${result[lookup4096_gbs]}
awk -v ip="$iperf" -v lg="$lg" -v lk="$lk" -v rd="$redis" -v pr="${result[push4096_rows]}" \
    -v l65="${result[lookup65536_rows]}" -v g65="${result[lookup65536_gbs]}" -v p65="${result[push65536_rows]}" \
    -v lp="${result[lookup4096_p50]}" -v pp="${result[push4096_p50]}" 'BEGIN {
  printf "\n%-44s %14s\n", "measurement (median)", "value"
  printf "%-44s %14.3f\n", "iperf3 single-stream loopback GB/s", ip
  printf "%-44s %14.0f\n", "embps lookup 4096x128 f32 rows/s", lk
  printf "%-44s %14.3f\n", "embps lookup 4096x128 f32 GB/s", lg
  printf "%-44s %14.3f\n", "embps lookup 4096x128 p50 ms", lp
  printf "%-44s %14.0f\n", "embps push 4096x128 rowwise_adagrad rows/s", pr
  printf "%-44s %14.3f\n", "embps push 4096x128 p50 ms", pp
  printf "%-44s %14.0f\n", "embps lookup 65536x128 f32 rows/s", l65
  printf "%-44s %14.3f\n", "embps lookup 65536x128 f32 GB/s", g65
  printf "%-44s %14.0f\n", "embps push 65536x128 rows/s", p65
  printf "%-44s %14.0f\n", "redis MGET 4096 x 512B rows/s", rd
  printf "%-44s %13.1f%%  (target >= 70%%)\n", "lookup GB/s / iperf3 GB/s", 100*lg/ip
  printf "%-44s %13.1fx  (target >= 8x)\n", "lookup rows/s / redis rows/s", lk/rd
  printf "%-44s %13.2fx  (target <= 1.5x)\n", "push time / lookup time (4096)", lk/pr
}'
