#!/usr/bin/env bash
# Quick start on a fresh Debian machine: installs the packages embps needs, builds it, starts
# a 2-rank shard group on loopback, creates a table and load-tests it with the CLI (throughput,
# latency). Ports are picked free by the script; both servers stop when it exits. With
# --example it then trains examples/train_mf.py (PyTorch) against the same group.
#
#   deploy/quickstart.sh [--duration SECONDS] [--batch TOKENS] [--example]
set -euo pipefail
cd "$(dirname "$0")/.."

duration=5
batch=4096
example=0
while [ $# -gt 0 ]; do
  case $1 in
    --duration) duration=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --example) example=1; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

deploy/packages.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)" --target embps-server embps >/dev/null

# Two client ports P0, P1 and a peer-port offset O such that P0+O and P1+O are free as well.
read -r p0 p1 offset < <(/usr/bin/python3 deploy/group_ports.py)
peers=127.0.0.1:$p0,127.0.0.1:$p1

work=$(mktemp -d /tmp/embps-quickstart.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
# The ranks prove to each other that they belong to the group with a shared secret.
(umask 077 && head -c 32 /dev/urandom | base64 >"$work/group-secret")
for r in 0 1; do
  build/bin/embps-server --rank "$r" --peers "$peers" --peer-port-offset "$offset" \
    --group-secret-file "$work/group-secret" >"$work/rank$r.log" 2>&1 &
  pids+=($!)
done
echo "shard group: rank 0 at 127.0.0.1:$p0 (pid ${pids[0]}), rank 1 at 127.0.0.1:$p1 (pid ${pids[1]}), peer ports +$offset"

embps="build/bin/embps --servers $peers"
up=0
for _ in $(seq 100); do   # up to ~30 s
  if $embps --connect-timeout-ms 1000 --deadline-ms 2000 health >/dev/null 2>&1; then up=1; break; fi
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || break 2; done
  sleep 0.3
done
if [ $up != 1 ]; then
  for r in 0 1; do echo "---- rank $r log"; cat "$work/rank$r.log"; done
  echo "the shard group did not become healthy" >&2
  exit 1
fi
$embps health
$embps create-table quickstart --rows 1000000 --emb-width 128 \
  --optimizer rowwise_adagrad --lr 0.01
$embps tables
$embps lookup quickstart --tokens 1,2,3,4 | cut -c1-100
$embps push quickstart --tokens 1,2,3,4 --grad-value 0.1
$embps lookup quickstart --tokens 1,2,3,4 | cut -c1-100
$embps bench quickstart --batch "$batch" --duration "$duration" \
  --concurrency 2 --zipf 1.05 --push-ratio 0.5
$embps stats
if [ $example = 1 ]; then
  /usr/bin/python3 examples/train_mf.py --servers "$peers"
fi
