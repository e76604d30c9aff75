#!/usr/bin/env bash
# End-to-end check of the CUDA backend through the real server and CLI (step (d) of
# tests/gpu/check.sh; runs alone too):
#
#   tests/gpu/e2e_cuda.sh BUILD_DIR [OUT_DIR]       device: $EMBPS_GPU_DEVICE (default 0)
#
# A 1-rank group with --device cuda:N and, beside it, the same group with --device cpu (every
# server gets its --device flag, which wins over an EMBPS_DEVICE in the environment).
# On both: health, create-table (f32 width 128 and bf16 width 1024, rowwise Adagrad), lookup,
# push, lookup; the CUDA server's rows must equal the CPU server's text for text (the kernels
# are bit for bit the CPU's), and the push must have moved every looked-up value. Then `stats`
# must say backend cuda, the server's log must show its 1-rank NCCL communicator, and
# `bench --batch 65536 --duration 5 --json` measures lookups and pushes (Zipf 1.05) on the
# CUDA server; the server must stop with exit 0 on SIGTERM. Checkpoints cross the backends: the
# CUDA server's checkpoint (its device-to-host capture) restored into a CPU server and the CPU
# server's restored into a CUDA one (its import) must look up the same rows as the servers that
# wrote them, and take one more push alike (the optimizer state came across too).
# Exit 0: passed; 77: skipped (no CUDA backend in the server yet, or no GPU visible); else
# failed. Writes server logs, CLI outputs and the bench JSON to OUT_DIR.
# EMBPS_E2E_BACKEND=cpu runs the same flow with the "cuda" server on --device cpu: a dry run of
# this script on a machine without a GPU. EMBPS_E2E_SERVER names another server binary for both
# servers (no GPU probe then): tests/unit/engine_sim's embps-server-sim runs the whole flow on
# the simulated CUDA runtime (SIM_CUDA_DEVICES=1). EMBPS_E2E_BENCH_S: seconds per bench (5).
set -uo pipefail

BUILD=${1:?usage: e2e_cuda.sh BUILD_DIR [OUT_DIR]}
OUTD=${2:-$(mktemp -d /tmp/embps-e2e.XXXXXX)}
DEVICE=${EMBPS_GPU_DEVICE:-0}
BACKEND=${EMBPS_E2E_BACKEND:-cuda}
SERVER=${EMBPS_E2E_SERVER:-$BUILD/bin/embps-server}
BENCH_S=${EMBPS_E2E_BENCH_S:-5}
CLI=$BUILD/bin/embps
PROBE=$BUILD/bin/bench_kernels_gpu
mkdir -p "$OUTD"

fail() {
  echo "FAIL e2e: $*"
  exit 1
}
if [ ! -x "$SERVER" ] || [ ! -x "$CLI" ]; then fail "no $SERVER or $CLI"; fi

help=$("$SERVER" --help 2>&1)
# The --device entry: its line (and the wrapped description, if any) up to the env line.
device_help=$(awk '/^ *--device/ {on = 1} on {print} on && /env EMBPS_DEVICE/ {exit}' <<<"$help")
if ! grep -qw "$BACKEND" <<<"$device_help"; then
  echo "SKIP e2e: server has no CUDA backend yet (--device: $(head -1 <<<"$device_help" | sed 's/^ *--device *//'))"
  exit 77
fi
if [ "$BACKEND" = cuda ] && [ -z "${EMBPS_E2E_SERVER:-}" ] && [ -x "$PROBE" ]; then
  "$PROBE" --probe --device "$DEVICE"
  rc=$?
  if [ "$rc" -eq 77 ]; then
    echo "SKIP e2e: no GPU visible"
    exit 77
  fi
  [ "$rc" -eq 0 ] || fail "device probe failed (rc $rc)"
fi

# ---- servers --------------------------------------------------------------------------------
declare -A PID=() ADDR=()
stop_all() {
  local b
  for b in "${!PID[@]}"; do
    kill -TERM "${PID[$b]}" 2>/dev/null
  done
  for b in "${!PID[@]}"; do
    wait "${PID[$b]}" 2>/dev/null
  done
}
trap stop_all EXIT
trap 'exit 143' TERM INT # so that a timeout still stops the servers (through the EXIT trap)

start_server() { # start_server NAME FLAGS...
  local name=$1 log=$OUTD/server-$1.log
  shift
  : >"$log" # emptied here, not by the background redirection: a previous run's port must not be read
  "$SERVER" --listen 127.0.0.1:0 "$@" >"$log" 2>&1 &
  PID[$name]=$!
  local i port=
  for ((i = 0; i < 600; i++)); do # 60 s: CUDA initialization can take a while
    port=$(grep -o 'listening on 127\.0\.0\.1:[0-9]*' "$log" | head -1 | sed 's/.*://')
    [ -n "$port" ] && break
    kill -0 "${PID[$name]}" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$port" ]; then
    cat "$log"
    fail "the $name server did not start"
  fi
  ADDR[$name]=127.0.0.1:$port
  echo "$name server: pid ${PID[$name]} on ${ADDR[$name]}: $(grep -m1 'embps-server' "$log" | sed 's/^.*main\.c:[0-9]* //')"
}

if [ "$BACKEND" = cuda ]; then
  cuda_flags=(--device "cuda:$DEVICE")
else
  cuda_flags=(--device "$BACKEND")
fi
# Empty checkpoint directories: a reused OUTD (ctest's build directory) keeps an earlier run's
# checkpoints, whose rounds can be higher than this run's, and --checkpoint-keep would then
# remove this run's checkpoint as the oldest before it is restored.
rm -rf "$OUTD/ckpt-cuda" "$OUTD/ckpt-cpu"
mkdir -p "$OUTD/ckpt-cuda" "$OUTD/ckpt-cpu"
start_server cuda "${cuda_flags[@]}" --checkpoint-dir "$OUTD/ckpt-cuda" --restore none
start_server cpu --device cpu --checkpoint-dir "$OUTD/ckpt-cpu" --restore none

cli() { # cli NAME ARGS...: the CLI against server NAME, output also saved
  local name=$1
  shift
  timeout 60 "$CLI" --servers "${ADDR[$name]}" "$@"
}

# wait_serving NAME: health until it says SERVING, 60 s at most. A server listens before its
# group is ready (on a GPU, NCCL's set-up alone took 0.5 s on the H200) and says NOT_SERVING
# until then, or until a restore is done.
wait_serving() {
  local i out
  for ((i = 0; i < 600; i++)); do
    out=$(cli "$1" health 2>&1) && grep -qw SERVING <<<"${out//NOT_SERVING/}" && return 0
    sleep 0.1
  done
  fail "$1: not SERVING 60 s after it started: $out (log: $OUTD/server-$1.log)"
}

# ---- the same calls on both servers -------------------------------------------------------------
tables=("e2e_f32 --rows 1000000 --emb-width 128 --dtype f32"
  "e2e_bf16 --rows 100000 --emb-width 1024 --dtype bf16")
tokens=1,2,3,999,2,0,77777
for name in cuda cpu; do
  wait_serving "$name"
  for t in "${tables[@]}"; do
    # shellcheck disable=SC2086 # the table spec is split on purpose
    set -- $t
    table=$1
    shift
    cli "$name" create-table "$table" "$@" --optimizer rowwise_adagrad --lr 0.05 --seed 11 \
      >"$OUTD/$name-$table-create.txt" 2>&1 || fail "$name: create-table $table: $(cat "$OUTD/$name-$table-create.txt")"
    cli "$name" lookup "$table" --tokens "$tokens" >"$OUTD/$name-$table-lookup1.txt" 2>&1 ||
      fail "$name: lookup $table: $(head -3 "$OUTD/$name-$table-lookup1.txt")"
    cli "$name" push "$table" --tokens "$tokens" --grad-value 0.25 >"$OUTD/$name-$table-push.txt" 2>&1 ||
      fail "$name: push $table: $(cat "$OUTD/$name-$table-push.txt")"
    grep -q 'applied=1' "$OUTD/$name-$table-push.txt" || fail "$name: push $table: $(cat "$OUTD/$name-$table-push.txt")"
    cli "$name" lookup "$table" --tokens "$tokens" >"$OUTD/$name-$table-lookup2.txt" 2>&1 ||
      fail "$name: second lookup $table: $(head -3 "$OUTD/$name-$table-lookup2.txt")"
  done
done

for t in "${tables[@]}"; do
  table=${t%% *}
  n=$(wc -l <"$OUTD/cuda-$table-lookup1.txt")
  [ "$n" -eq 7 ] || fail "$table: lookup printed $n lines, not 7"
  # Every value of every token but the padding token 0 must have decreased (grad 0.25 > 0).
  moved=$(paste -d' ' "$OUTD/cuda-$table-lookup1.txt" "$OUTD/cuda-$table-lookup2.txt" | awk '
    { half = NF / 2; if ($1 == 0) next
      for (i = 2; i <= half; i++) if (!($(half + i) < $i)) bad++; n += half - 1 }
    END { printf "%d %d", n, bad + 0 }')
  [ "${moved#* }" = 0 ] || fail "$table: ${moved#* } of ${moved% *} values did not decrease after the push"
  # push prints applied, skipped, grad_norm, num_unique: grad_norm is summed by a tree on the
  # GPU (within rounding of the CPU's), the rest must be equal.
  pc=$(cat "$OUTD/cpu-$table-push.txt") pg=$(cat "$OUTD/cuda-$table-push.txt")
  if [ "${pc/grad_norm=* / }" != "${pg/grad_norm=* / }" ] || ! awk -v a="$pc" -v b="$pg" 'BEGIN {
      sub(/.*grad_norm=/, "", a); sub(/ .*/, "", a); sub(/.*grad_norm=/, "", b); sub(/ .*/, "", b)
      d = a - b; if (d < 0) d = -d; exit !(d <= 1e-6 * (a < 0 ? -a : a) + 1e-30) }'; then
    fail "$table: push replies differ: CPU '$pc', CUDA '$pg'"
  fi
  for f in lookup1 lookup2; do
    if ! cmp -s "$OUTD/cuda-$table-$f.txt" "$OUTD/cpu-$table-$f.txt"; then
      diff "$OUTD/cpu-$table-$f.txt" "$OUTD/cuda-$table-$f.txt" | head -6
      fail "$table: $f differs between the CUDA and the CPU server"
    fi
  done
  echo "ok: $table: lookup, push ($(cat "$OUTD/cuda-$table-push.txt")), lookup: ${moved% *} values moved, identical to the CPU server"
done

stats=$(cli cuda stats --json) || fail "stats: $stats"
echo "$stats" >"$OUTD/stats-before-bench.json"
grep -q "\"backend\":\"$BACKEND\"" <<<"$stats" || fail "stats do not say backend $BACKEND: $(head -c 300 <<<"$stats")"
echo "ok: stats say backend $BACKEND"
# The collectives of a cuda group are NCCL's, even with one rank (server/group/formation.c): the
# communicator must have come up (server/comm/comm_nccl.c logs it).
if [ "$BACKEND" = cuda ]; then
  nccl=$(grep -m1 'comm nccl rank 0/1 .*ready' "$OUTD/server-cuda.log") ||
    fail "the cuda server's log does not show its 1-rank NCCL communicator ('comm nccl rank 0/1 ... ready')"
  echo "ok: 1-rank NCCL group: ${nccl#*comm nccl }"
fi

# ---- checkpoints across backends ------------------------------------------------------------------
for name in cuda cpu; do
  cli "$name" checkpoint >"$OUTD/$name-checkpoint.txt" 2>&1 ||
    fail "$name: checkpoint: $(cat "$OUTD/$name-checkpoint.txt")"
done
ckpt_of() { sed -n 's/^checkpoint complete: .*bytes, //p' "$OUTD/$1-checkpoint.txt"; }
# the CUDA server's checkpoint into a CPU server, the CPU server's into a CUDA one
start_server from_cuda --device cpu --restore "$(ckpt_of cuda)"
start_server from_cpu "${cuda_flags[@]}" --restore "$(ckpt_of cpu)"
for name in from_cuda from_cpu; do
  wait_serving "$name"
done
second_push() { # second_push NAME TABLE: one more push, then lookup3
  cli "$1" push "$2" --tokens "$tokens" --grad-value 0.25 >"$OUTD/$1-$2-push2.txt" 2>&1 ||
    fail "$1: push $2: $(cat "$OUTD/$1-$2-push2.txt")"
  cli "$1" lookup "$2" --tokens "$tokens" >"$OUTD/$1-$2-lookup3.txt" 2>&1 ||
    fail "$1: lookup $2 after the push: $(head -3 "$OUTD/$1-$2-lookup3.txt")"
}
for pair in "from_cuda cuda" "from_cpu cpu"; do
  # shellcheck disable=SC2086 # the pair is split on purpose
  set -- $pair
  for t in "${tables[@]}"; do
    table=${t%% *}
    cli "$1" lookup "$table" --tokens "$tokens" >"$OUTD/$1-$table-lookup.txt" 2>&1 ||
      fail "$1: lookup $table: $(head -3 "$OUTD/$1-$table-lookup.txt")"
    cmp -s "$OUTD/$1-$table-lookup.txt" "$OUTD/$2-$table-lookup2.txt" ||
      fail "$table: restored from the $2 server's checkpoint, the $1 server looks up other rows"
    # the same push on the restored server and on the one that wrote the checkpoint: equal rows
    # after it only if the accumulators came across too
    second_push "$1" "$table"
    second_push "$2" "$table"
    if ! cmp -s "$OUTD/$1-$table-lookup3.txt" "$OUTD/$2-$table-lookup3.txt"; then
      diff "$OUTD/$2-$table-lookup3.txt" "$OUTD/$1-$table-lookup3.txt" | head -6
      fail "$table: after one more push the $1 server differs from the $2 server (optimizer state lost?)"
    fi
  done
done
for t in "${tables[@]}"; do
  echo "ok: ${t%% *}: checkpoints restored across backends (cuda -> cpu, cpu -> cuda): same rows, same next push"
done
for name in from_cuda from_cpu; do
  kill -TERM "${PID[$name]}"
  wait "${PID[$name]}"
  rc=$?
  unset "PID[$name]"
  [ "$rc" -eq 0 ] || fail "the $name server exited with $rc on SIGTERM (log: $OUTD/server-$name.log)"
done

# ---- throughput ---------------------------------------------------------------------------------
for kind in lookup push; do
  ratio=0
  [ "$kind" = push ] && ratio=1
  cli cuda bench e2e_f32 --batch 65536 --duration "$BENCH_S" --zipf 1.05 --push-ratio "$ratio" --json \
    >"$OUTD/bench-$kind.json" 2>"$OUTD/bench-$kind.err" || fail "bench ($kind): $(cat "$OUTD/bench-$kind.err")"
  j=$(cat "$OUTD/bench-$kind.json")
  field() { grep -o "\"$1\":[0-9.eE+-]*" <<<"$j" | head -1 | cut -d: -f2; }
  printf 'E2E %-6s batch 65536 f32 w128: %s batches/s, %s rows/s, %s GB/s, p50 %s ms, p99 %s ms\n' \
    "$kind" "$(field "${kind}_batches_per_s")" "$(field "${kind}_rows_per_s")" \
    "$(field "${kind}_gbytes_per_s")" "$(field "${kind}_p50_ms")" "$(field "${kind}_p99_ms")"
done
stats=$(cli cuda stats --json) || fail "stats after bench: $stats"
echo "$stats" >"$OUTD/stats-after-bench.json"
grep -q '"errors":0,' <<<"$stats" || echo "note: the server counted errors: $(grep -o '"errors":[0-9]*' <<<"$stats")"

# ---- shutdown -------------------------------------------------------------------------------------
trap - EXIT
for name in cuda cpu; do
  kill -TERM "${PID[$name]}"
  wait "${PID[$name]}"
  rc=$?
  [ "$rc" -eq 0 ] || fail "the $name server exited with $rc on SIGTERM (log: $OUTD/server-$name.log)"
done
echo "PASS e2e"
