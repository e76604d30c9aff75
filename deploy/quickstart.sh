#!/usr/bin/env bash
# Quick start on a fresh Debian machine: installs the packages embps needs, builds it, starts
# a server on loopback, creates a table and load-tests it with the CLI (throughput, latency).
#
#   deploy/quickstart.sh [--duration SECONDS] [--batch TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."

duration=5
batch=4096
while [ $# -gt 0 ]; do
  case $1 in
    --duration) duration=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

deploy/packages.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)" --target embps-server embps >/dev/null

log=$(mktemp /tmp/embps-quickstart.XXXXXX.log)
build/bin/embps-server --listen 127.0.0.1:0 >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 100); do
  addr=$(grep -o 'listening on [0-9.]*:[0-9]*' "$log" | awk '{print $3}') && [ -n "$addr" ] && break
  sleep 0.1
done
[ -n "${addr:-}" ] || { cat "$log"; echo "server did not start" >&2; exit 1; }
echo "server listening on $addr"

embps=build/bin/embps
$embps --servers "$addr" health
$embps --servers "$addr" create-table quickstart --rows 1000000 --emb-width 128 \
  --optimizer rowwise_adagrad --lr 0.01
$embps --servers "$addr" tables
$embps --servers "$addr" lookup quickstart --tokens 1,2,3 | cut -c1-100
$embps --servers "$addr" bench quickstart --batch "$batch" --duration "$duration" \
  --concurrency 2 --zipf 1.05 --push-ratio 0.5
$embps --servers "$addr" stats
