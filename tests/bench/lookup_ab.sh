#!/usr/bin/env bash
# Interleaved A/B of lookup throughput between builds, for the targets of issue 13: each
# DIR holds an embps and an embps-server; one server per build runs with its own 1M x 128 f32
# table, and every round measures the iperf3 ceiling (1 MiB writes) and then each case on each
# build in turn, so that ratios come from the same minutes of a shared machine.
#
#   tests/bench/lookup_ab.sh ROUNDS SECONDS DIR...
# Cases: uniform tokens, one client stream: 4096 tokens one call in flight, 4096 two in flight on
# one connection, 65536 one in flight. Prints one line per measurement (GB/s of rows, p50, p99).
set -u
[ $# -ge 3 ] || { sed -n '2,9p' "$0"; exit 2; }
rounds=$1
dur=$2
shift 2
work=$(mktemp -d /tmp/embps-ab.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
declare -A addr
i=0
for v in "$@"; do
  "$v/embps-server" --listen 127.0.0.1:0 >"$work/s$i.log" 2>&1 &
  pids+=($!)
  a=
  for _ in $(seq 100); do
    a=$(grep -o 'listening on [0-9.]*:[0-9]*' "$work/s$i.log" | awk '{print $3}') && [ -n "$a" ] && break
    sleep 0.1
  done
  [ -n "$a" ] || { cat "$work/s$i.log"; echo "$v: the server did not start" >&2; exit 1; }
  addr[$v]=$a
  "$v/embps" --servers "$a" create-table bench --rows 1000000 --emb-width 128 --dtype f32 >/dev/null
  i=$((i + 1))
done
iport=$(free_port)
iperf3 -s -B 127.0.0.1 -p "$iport" >/dev/null 2>&1 &
pids+=($!)
sleep 0.3
for r in $(seq "$rounds"); do
  gbs=$(iperf3 -c 127.0.0.1 -p "$iport" -t "$dur" -l 1M -J |
        /usr/bin/python3 -c 'import json,sys; print("%.3f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 8e9))')
  echo "round $r iperf3 1M writes $gbs GB/s"
  for c in "4096 1" "4096 2" "65536 1"; do
    set -- $c
    for v in "${!addr[@]}"; do
      out=$("$v/embps" --servers "${addr[$v]}" bench bench --batch "$1" --pipeline "$2" \
            --duration "$dur" --warmup 0.5 --json)
      echo "round $r $v batch=$1 in_flight=$2 $(/usr/bin/python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.3f GB/s p50 %.3f ms p99 %.3f ms" % (d["lookup_gbytes_per_s"], d["p50_ms"], d["p99_ms"]))' <<<"$out")"
    done
  done
done
