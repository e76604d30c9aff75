#!/usr/bin/env bash
# Before/after: the same loopback benchmark against two builds in one run, interleaved, so that a
# change can be judged on a shared, noisy machine by ratios and medians rather than by figures
# taken at different times.
#
#   tests/bench/compare.sh BEFORE_DIR AFTER_DIR [--repeat N] [--duration S] [--ranks 1|2]
#                          [--rows R] [--batches "4096 65536"]
# Each DIR holds bin/embps-server and bin/embps (a build directory, or a copy of one). Every
# round starts each build's server (or 2-rank group) in turn, alternating which goes first,
# creates a rows x 128 f32 rowwise-Adagrad table, and runs `embps bench` lookups and pushes of
# each batch size, one client stream, uniform tokens (--zipf 0). Prints every figure, then a
# table of medians (rows/s) and the after/before ratio.
set -euo pipefail
cd "$(dirname "$0")/../.."

[ $# -ge 2 ] || { sed -n '2,12p' "$0"; exit 2; }
before=$1 after=$2; shift 2
repeat=5 duration=3 ranks=1 rows=1000000 batches="4096 65536"
while [ $# -gt 0 ]; do
  case $1 in
    --repeat) repeat=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --rows) rows=$2; shift 2 ;;
    --batches) batches=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
for d in "$before" "$after"; do
  [ -x "$d/bin/embps-server" ] && [ -x "$d/bin/embps" ] || { echo "$d has no bin/embps-server and bin/embps" >&2; exit 2; }
done

work=$(mktemp -d /tmp/embps-compare.XXXXXX)
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap 'stop; rm -rf "$work"' EXIT
jget() { /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
ports() { /usr/bin/python3 deploy/group_ports.py; }

# run_side NAME DIR: one round of every measurement against DIR's build; appends to $work/NAME.*
run_side() {
  local name=$1 dir=$2 p0 p1 off servers
  read -r p0 p1 off < <(ports)
  if [ "$ranks" = 1 ]; then
    servers=127.0.0.1:$p0
    "$dir/bin/embps-server" --listen "$servers" >"$work/$name.log" 2>&1 &
    pids+=($!)
  else
    servers=127.0.0.1:$p0,127.0.0.1:$p1
    for r in 0 1; do
      "$dir/bin/embps-server" --rank "$r" --peers "$servers" --peer-port-offset "$off" \
        >"$work/$name.$r.log" 2>&1 &
      pids+=($!)
    done
  fi
  local E="$dir/bin/embps --servers $servers" up=0
  for _ in $(seq 150); do
    $E --connect-timeout-ms 1000 --deadline-ms 2000 health >/dev/null 2>&1 && { up=1; break; }
    sleep 0.2
  done
  [ $up = 1 ] || { cat "$work/$name"*.log >&2; echo "$name: the server did not become healthy" >&2; exit 1; }
  $E create-table bench --rows "$rows" --emb-width 128 --dtype f32 --optimizer rowwise_adagrad >/dev/null
  for b in $batches; do
    for ratio in 0 1; do
      local op=lookup out
      [ "$ratio" = 1 ] && op=push
      out=$($E bench bench --batch "$b" --duration "$duration" --concurrency 1 --zipf 0 \
                 --push-ratio "$ratio" --warmup 1 --json)
      echo "$(jget "${op}_rows_per_s" <<<"$out")" >>"$work/$name.$op$b"
      echo "$name $op $b: $(jget "${op}_rows_per_s" <<<"$out") rows/s"
    done
  done
  stop
}

for i in $(seq "$repeat"); do
  if [ $((i % 2)) = 1 ]; then run_side before "$before"; run_side after "$after"
  else run_side after "$after"; run_side before "$before"; fi
done

echo
echo "medians of $repeat interleaved rounds, $ranks rank(s), ${rows} x 128 f32, rowwise Adagrad, uniform tokens"
printf '%-14s %14s %14s %8s\n' measurement before after ratio
for b in $batches; do
  for op in lookup push; do
    mb=$(median <"$work/before.$op$b"); ma=$(median <"$work/after.$op$b")
    printf '%-14s %14.0f %14.0f %8.3f\n' "$op $b" "$mb" "$ma" "$(awk -v a="$ma" -v b="$mb" 'BEGIN{print a/b}')"
  done
done
