#!/usr/bin/env bash
# The loopback benchmark of issue 2, in one run:
#   1. single-stream loopback TCP bandwidth with iperf3 (the ceiling),
#   2. embps lookup and push throughput at batch 4096 x 128 f32 and 65536 x 128 f32
#      (rowwise Adagrad), one client stream,
#   3. the same on a 2-rank shard group on loopback (columns split over the ranks), plus the
#      bytes each rank sends to its peer per lookup / push batch (from `embps stats --json`
#      around each run) against the minimum the column split needs,
#   4. Redis (Debian's redis-server) serving the same 512-byte rows with MGET of 4096 keys.
# Prints one table at the end. Repeats each measurement REPEAT times and quotes medians.
#
#   tests/bench/run.sh [--duration S] [--repeat N] [--rows R] [--tokens uniform|zipf] [--perf]
#                      [--no-hash] [--features | --features-only] [--feature-rows R]
#                      [--feature-tables N] [--feature-batch B]
# --tokens: how the bench draws token ids over the table (embps bench --tokens): uniform, the
#   default, touches every row alike, so batches reach memory (the hard case); zipf (exponent
#   1.05) repeats hot rows, which then sit in cache and dedup shrinks the push.
# Then (unless --no-hash) the same lookups and pushes on a hash-keyed table of capacity R (the
#   dense table's rows), its keys drawn from --key-space 10 x R (a full table that evicts on every
#   push), uniform and Zipf, each against the dense table under the same draw: hash / dense.
#   This adds 4 x 4 x REPEAT runs of S seconds (plus filling the table first).
# --perf also records a CPU profile of the server during a lookup run and during a push run, and
#   prints their top entries.
# The table ends with the ratios issue 13 asks for: lookup GB/s at 4096 (one and two in flight)
# and 65536 against the iperf3 1 MiB ceiling, push rows/s against lookup rows/s at 4096 and
# 65536 (measured one after the other on the same server in the same run), and p99/p50 of the
# 4096 lookup; then the lookups against tests/bench/lookup_ref.c over raw TCP: a call with the
# same request and reply sizes and no work (the loopback's ceiling for a lookup-sized reply), and
# the same lookup with nothing but the row gather and the send. Last, the CPU time each batch
# costs the server (its process's user + system time over the run, from /proc, divided by the
# batches its stats counted) and the bench client (its client_cpu_s over its calls), and from
# them the most push rows/s this machine's cores allow with client and server on it: when both
# share the cores, a push cannot go faster than all of them busy on it, whatever overlaps.
# --features adds, at the end, feature batches (issue 32) on a DLRM-DCNv2-shaped feature set: the
#   26 features of MLPerf's multi-hot sizes (3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,
#   1,1 ids per sample, 214 in all, sum-pooled), 128-wide f32, batch 2048 samples (--feature-batch),
#   feature i on table i mod N of --feature-tables N (default 26) tables of --feature-rows rows
#   (default 100000; rowwise Adagrad). On one server, then on a 2-rank group, REPEAT rounds each
#   run, interleaved, `embps bench --features` (one LookupFeatures/PushFeatures per rank and
#   step, pooled on the servers) and the same steps with --per-table (one Lookup/PushGradients
#   per table and step, pooled and expanded by the client, as before feature batches), lookups and
#   pushes apart, and prints the medians: samples/s, the client<->server bytes per sample (every
#   rank's GetStats bytes_in + bytes_out over the run, warm-up included, over the steps the servers
#   counted) and, on the group, the peer bytes per step (the most any rank sent, GetStats
#   peer_bytes_sent), with the issue's targets (bytes at least 6x fewer, samples/s at least 4x).
#   --features-only runs this section alone.
set -euo pipefail
cd "$(dirname "$0")/../.."

duration=5
repeat=3
rows=1000000
perf=0
tokens=uniform
hash=1
features=0
feature_rows=100000
feature_tables=26
feature_batch=2048
while [ $# -gt 0 ]; do
  case $1 in
    --features) features=1; shift ;;
    --features-only) features=2; shift ;;
    --feature-rows) feature_rows=$2; shift 2 ;;
    --feature-tables) feature_tables=$2; shift 2 ;;
    --feature-batch) feature_batch=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --rows) rows=$2; shift 2 ;;
    --perf) perf=1; shift ;;
    --no-hash) hash=0; shift ;;
    --tokens) tokens=$2; shift 2 ;;
    -h|--help) sed -n '2,48p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
case $tokens in uniform|zipf) ;; *) echo "--tokens takes uniform or zipf, not '$tokens'" >&2; exit 2 ;; esac

deploy/packages.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)" --target embps-server embps lookup_ref >/dev/null

work=$(mktemp -d /tmp/embps-bench.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
jget() { /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }
clk_tck=$(getconf CLK_TCK)
# The CPU ticks (user + system) the server processes in SERVER_PIDS have used so far.
server_ticks() {
  local t=0 p
  for p in $SERVER_PIDS; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done
  echo "$t"
}

# ---- 5. feature batches (issue 32) ---------------------------------------------------------------
# The DLRM-DCNv2 feature set: MLPerf's multi-hot sizes, one feature each, sum-pooled.
DLRM_SIZES="3 2 1 2 6 1 1 1 1 7 3 8 1 6 9 5 1 1 1 12 100 27 10 3 1 1"
feature_spec=$(for b in $DLRM_SIZES; do printf '1x%s:sum,' "$b"; done)
feature_spec=${feature_spec%,}
# fstats_delta BEFORE AFTER TABLE COUNTER K BATCH: prints "client_bytes_per_sample
# peer_bytes_per_step steps" from two `embps stats --json`: the steps are rank 0's delta of
# TABLE's COUNTER over K (a feature lookup counts once per feature of the table), the client bytes
# every rank's bytes_in + bytes_out, the peer bytes the most any rank sent.
fstats_delta() {
  /usr/bin/python3 - "$@" <<'PY'
import json, sys
before, after = json.loads(sys.argv[1]), json.loads(sys.argv[2])
table, counter, k, batch = sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
def tab(r):
    return next(t for t in r["tables"] if t["name"] == table)
steps = (tab(after[0])[counter] - tab(before[0])[counter]) // k
client = sum(a["bytes_in"] - b["bytes_in"] + a["bytes_out"] - b["bytes_out"]
             for a, b in zip(after, before))
peer = max(a["peer_bytes_sent"] - b["peer_bytes_sent"] for a, b in zip(after, before))
print("%.1f %.1f %d" % (client / max(steps * batch, 1), peer / max(steps, 1), steps))
PY
}
# run_features PREFIX (E and NRANKS set): creates the tables, then REPEAT rounds of the four runs,
# interleaved; stores fres[PREFIX{lookup,push}_{features,per_table}_{sps,bytes,peer}] (medians).
declare -A fres
run_features() {
  local pre=$1 names="" t k0
  for t in $(seq 0 $((feature_tables - 1))); do
    $E create-table "ft$t" --rows "$feature_rows" --emb-width 128 --dtype f32 \
      --optimizer rowwise_adagrad >/dev/null
    names+="ft$t,"
  done
  names=${names%,}
  k0=$(( (26 + feature_tables - 1) / feature_tables )) # features on ft0
  declare -A fvals
  for _ in $(seq "$repeat"); do
    for op in lookup push; do
      for mode in features per_table; do
        local ratio=0 counter=lookups k=$k0 before after out d
        [ "$op" = push ] && { ratio=1; counter=pushes; k=1; }
        [ "$mode" = per_table ] && k=1
        before=$($E stats --json)
        # shellcheck disable=SC2046 # the flag is empty or one word
        out=$($E bench "$names" --features "$feature_spec" --batch "$feature_batch" \
                 --duration "$duration" --warmup 1 --push-ratio "$ratio" --json \
                 $([ "$mode" = per_table ] && echo --per-table))
        after=$($E stats --json)
        d=$(fstats_delta "$before" "$after" ft0 "$counter" "$k" "$feature_batch")
        fvals[${op}_${mode}_sps]+="$(jget samples_per_s <<<"$out") "
        fvals[${op}_${mode}_bytes]+="$(awk '{print $1}' <<<"$d") "
        fvals[${op}_${mode}_peer]+="$(awk '{print $2}' <<<"$d") "
        echo "features ${pre}${op} ${mode}: $(jget samples_per_s <<<"$out") samples/s; $(awk '{printf "client bytes/sample %s, peer bytes/step %s, steps counted %s", $1, $2, $3}' <<<"$d")"
      done
    done
  done
  for key in "${!fvals[@]}"; do
    fres[${pre}${key}]=$(tr ' ' '\n' <<<"${fvals[$key]}" | grep . | median)
  done
}
features_section() {
  local fpid p0 p1 off up r
  echo "---- feature batches: $feature_spec over $feature_tables tables of $feature_rows rows, batch $feature_batch ----"
  build/bin/embps-server --listen 127.0.0.1:0 >"$work/fserver.log" 2>&1 &
  fpid=$!
  pids+=("$fpid")
  for _ in $(seq 100); do
    addr=$(grep -o 'listening on [0-9.]*:[0-9]*' "$work/fserver.log" | awk '{print $3}') && [ -n "$addr" ] && break
    sleep 0.1
  done
  E="build/bin/embps --servers $addr"
  run_features f1_
  kill "$fpid" 2>/dev/null || true; wait "$fpid" 2>/dev/null || true
  read -r p0 p1 off < <(/usr/bin/python3 deploy/group_ports.py)
  local fg=()
  for r in 0 1; do
    build/bin/embps-server --rank "$r" --peers "127.0.0.1:$p0,127.0.0.1:$p1" \
      --peer-port-offset "$off" >"$work/fgroup$r.log" 2>&1 &
    pids+=($!)
    fg+=($!)
  done
  E="build/bin/embps --servers 127.0.0.1:$p0,127.0.0.1:$p1"
  up=0
  for _ in $(seq 100); do
    $E --connect-timeout-ms 1000 --deadline-ms 2000 health >/dev/null 2>&1 && { up=1; break; }
    sleep 0.3
  done
  [ $up = 1 ] || { cat "$work"/fgroup*.log; echo "the 2-rank group did not become healthy" >&2; exit 1; }
  run_features f2_
  for r in "${fg[@]}"; do kill "$r" 2>/dev/null || true; wait "$r" 2>/dev/null || true; done
  printf "\n%-40s %12s %12s %9s %12s %12s %9s\n" \
    "feature batches (median of $repeat)" "1r features" "1r table" "ratio" "2r features" "2r table" "ratio"
  frow() { # LABEL OP FIELD INVERT TARGET
    awk -v l="$1" -v a="${fres[f1_${2}_features_$3]}" -v b="${fres[f1_${2}_per_table_$3]}" \
        -v c="${fres[f2_${2}_features_$3]}" -v d="${fres[f2_${2}_per_table_$3]}" -v inv="$4" \
        -v tgt="$5" 'BEGIN {
      r1 = inv ? (a > 0 ? b / a : 0) : (b > 0 ? a / b : 0)
      r2 = inv ? (c > 0 ? d / c : 0) : (d > 0 ? c / d : 0)
      printf "%-40s %12.0f %12.0f %8.2fx %12.0f %12.0f %8.2fx  %s\n", l, a, b, r1, c, d, r2, tgt }'
  }
  frow "lookup samples/s" lookup sps 0 "(target >= 4x)"
  frow "lookup client bytes/sample (fewer: x)" lookup bytes 1 "(target >= 6x fewer)"
  frow "push samples/s" push sps 0 "(target >= 4x)"
  frow "push client bytes/sample (fewer: x)" push bytes 1 "(target >= 6x fewer)"
  frow "lookup peer bytes/step (fewer: x)" lookup peer 1 "(2 ranks)"
  frow "push peer bytes/step (fewer: x)" push peer 1 "(2 ranks)"
  echo "(1r: one server; 2r: a 2-rank group; features: one LookupFeatures/PushFeatures per rank and step, pooled on the servers; table: one Lookup/PushGradients per table and step, pooled and expanded by the client)"
}

if [ "$features" = 2 ]; then
  features_section
  exit 0
fi

# ---- 1. iperf3 --------------------------------------------------------------------------------
iport=$(free_port)
iperf3 -s -B 127.0.0.1 -p "$iport" >/dev/null 2>&1 &
pids+=($!)
sleep 0.5
# iperf3's default 128 KiB writes are syscall-bound on some VMs; 1 MiB writes reach the
# stream's real ceiling, so both are measured and the faster is the ceiling.
declare -A iperf_at
for len in 128K 1M; do
  vals=()
  for _ in $(seq "$repeat"); do
    bps=$(iperf3 -c 127.0.0.1 -p "$iport" -t "$duration" -l "$len" -J | \
          /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"])')
    vals+=("$(awk -v b="$bps" 'BEGIN{printf "%.3f", b/8/1e9}')")
  done
  iperf_at[$len]=$(printf '%s\n' "${vals[@]}" | median)
  echo "iperf3 single stream, ${len} writes: ${vals[*]} GB/s (median ${iperf_at[$len]})"
done
iperf=$(printf '%s\n' "${iperf_at[128K]}" "${iperf_at[1M]}" | sort -g | tail -1)

# ---- 1b. the lookup reference -------------------------------------------------------------------
# tests/bench/lookup_ref.c, over raw loopback TCP with one call in flight: "transfer" is a call
# with a lookup's request and reply sizes and no work (the reply buffer sent as it stands), the
# loopback's ceiling for a reply of this size; "lookup" is a plain program doing only what a
# lookup must (one thread gathers the rows from a table of the same shape in the CPU engine's
# chunks, another sends each chunk as it is ready, the client reads them into one buffer);
# "gather" is the row gather alone on one thread. iperf3 streams between two cache-warm buffers;
# a lookup's reply is received into a buffer of its own size, and its rows are read at random
# from memory first.
zipf_a=0
[ "$tokens" = zipf ] && zipf_a=1.05
declare -A ref
for batch in 4096 65536; do
  vals=(); tvals=(); gvals=()
  for _ in $(seq "$repeat"); do
    out=$(build/bin/lookup_ref --rows "$rows" --batch "$batch" --seconds "$duration" --zipf "$zipf_a")
    vals+=("$(jget gbytes_per_s <<<"$out")")
    tvals+=("$(jget transfer_gbytes_per_s <<<"$out")")
    gvals+=("$(jget gather_gbytes_per_s <<<"$out")")
  done
  ref[$batch]=$(printf '%s\n' "${vals[@]}" | median)
  ref[t$batch]=$(printf '%s\n' "${tvals[@]}" | median)
  ref[g$batch]=$(printf '%s\n' "${gvals[@]}" | median)
  echo "raw TCP $batch x 128: plain lookup ${vals[*]} GB/s (median ${ref[$batch]}), transfer ${tvals[*]} (median ${ref[t$batch]}), gather alone ${gvals[*]} (median ${ref[g$batch]})"
done

# ---- 2. embps ---------------------------------------------------------------------------------
build/bin/embps-server --listen 127.0.0.1:0 >"$work/server.log" 2>&1 &
spid=$!
pids+=($spid)
SERVER_PIDS=$spid
for _ in $(seq 100); do
  addr=$(grep -o 'listening on [0-9.]*:[0-9]*' "$work/server.log" | awk '{print $3}') && [ -n "$addr" ] && break
  sleep 0.1
done
E="build/bin/embps --servers $addr"
$E create-table bench --rows "$rows" --emb-width 128 --dtype f32 --optimizer rowwise_adagrad >/dev/null

declare -A result
# run_embps KEY BATCH PUSH_RATIO: REPEAT runs of one client stream; stores the medians of
# result[KEY_rows], result[KEY_gbs], result[KEY_p50], result[KEY_p99] and, on a group (NRANKS > 1), of
# result[KEY_peer] (the most peer bytes any rank sent per batch) and result[KEY_peer_recv]; and
# the CPU milliseconds a batch took, result[KEY_scpu] for the servers together and
# result[KEY_ccpu] for the bench client.
# The table, its token draw and extra bench flags come from BTABLE (default bench), BTOKENS
# (default --tokens) and BFLAGS.
run_embps() {
  local key=$1 batch=$2 ratio=$3 pipeline=${4:-1} op=lookup counter=lookups
  [ "$ratio" = 1 ] && { op=push; counter=pushes; }
  local rates=() gbs=() p50=() p99=() peer=() peer_recv=() scpu=() ccpu=() out before after per
  local t_before t_after
  for _ in $(seq "$repeat"); do
    before=$($E stats --json)
    t_before=$(server_ticks)
    # shellcheck disable=SC2086 # BFLAGS is a list of flags
    out=$($E bench "${BTABLE:-bench}" --batch "$batch" --duration "$duration" --concurrency 1 \
               --tokens "${BTOKENS:-$tokens}" ${BFLAGS:-} --pipeline "$pipeline" --push-ratio "$ratio" --warmup 1 --json)
    t_after=$(server_ticks)
    after=$($E stats --json)
    rates+=("$(jget "${op}_rows_per_s" <<<"$out")")
    gbs+=("$(jget "${op}_gbytes_per_s" <<<"$out")")
    p50+=("$(jget p50_ms <<<"$out")")
    p99+=("$(jget p99_ms <<<"$out")")
    per=$(per_batch "$counter" "$before" "$after" "${BTABLE:-bench}" 2>"$work/peer.log")
    [ "${NRANKS:-1}" -gt 1 ] && cat "$work/peer.log" >&2
    peer+=("${per% * *}"); peer_recv+=("$(awk '{print $2}' <<<"$per")")
    scpu+=("$(awk -v d=$((t_after - t_before)) -v hz="$clk_tck" -v n="${per##* }" \
              'BEGIN{printf "%.4f", (n > 0 ? 1e3 * d / hz / n : 0)}')")
    ccpu+=("$(/usr/bin/python3 -c 'import json,sys; j=json.loads(sys.argv[1])
print("%.4f" % (1e3 * j["client_cpu_s"] / max(j["count"], 1)))' "$out")")
  done
  result[${key}_scpu]=$(printf '%s\n' "${scpu[@]}" | median)
  result[${key}_ccpu]=$(printf '%s\n' "${ccpu[@]}" | median)
  echo "embps $key: CPU ms per batch: server ${scpu[*]} (median ${result[${key}_scpu]}), client ${ccpu[*]} (median ${result[${key}_ccpu]})"
  result[${key}_rows]=$(printf '%s\n' "${rates[@]}" | median)
  result[${key}_gbs]=$(printf '%s\n' "${gbs[@]}" | median)
  result[${key}_p50]=$(printf '%s\n' "${p50[@]}" | median)
  result[${key}_p99]=$(printf '%s\n' "${p99[@]}" | median)
  echo "embps $key: rows/s ${rates[*]} (median ${result[${key}_rows]}), GB/s ${gbs[*]}, p50 ms ${p50[*]}, p99 ms ${p99[*]}"
  if [ "${NRANKS:-1}" -gt 1 ]; then
    result[${key}_peer]=$(printf '%s\n' "${peer[@]}" | median)
    result[${key}_peer_recv]=$(printf '%s\n' "${peer_recv[@]}" | median)
    echo "embps $key: peer bytes sent per batch (max over ranks) ${peer[*]} (median ${result[${key}_peer]})"
  fi
}
# per_batch COUNTER STATS_BEFORE STATS_AFTER TABLE: prints the largest per-rank
# (peer_bytes_sent delta / batches), the same for peer_bytes_received, and the batches (the
# largest rank's delta of the table's COUNTER, lookups or pushes: every rank counts every batch
# once, warm-up included, as are its bytes and its CPU time). Logs each rank's figures on stderr.
per_batch() {
  /usr/bin/python3 - "$1" "$2" "$3" "$4" <<'PY'
import json, sys
counter, before, after = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
def tab(r):
    return next(t for t in r["tables"] if t["name"] == sys.argv[4])
sent, recv, batches = [], [], []
for b, a in zip(before, after):
    n = tab(a)[counter] - tab(b)[counter]
    s = (a["peer_bytes_sent"] - b["peer_bytes_sent"]) / max(n, 1)
    r = (a["peer_bytes_received"] - b["peer_bytes_received"]) / max(n, 1)
    print("  rank %d: %d %s batches, %.0f peer bytes sent / batch, %.0f received / batch"
          % (a["rank"], n, counter, s, r), file=sys.stderr)
    sent.append(s); recv.append(r); batches.append(n)
print("%.0f %.0f %d" % (max(sent), max(recv), max(batches)))
PY
}
run_all() { # PREFIX
  run_embps "$1lookup4096" 4096 0
  run_embps "$1push4096" 4096 1
  run_embps "$1lookup65536" 65536 0
  run_embps "$1push65536" 65536 1
}
run_all ""
# One connection (one TCP stream) with two calls in flight, against Redis pipelining two MGETs.
run_embps lookup4096p2 4096 0 2

# ---- 2b. a hash-keyed table beside the dense one -------------------------------------------------
# Capacity = the dense table's rows, keys from 10 x as many: filled first by pushes (bounded), so
# every measured push evicts. Each draw is measured on both tables, prefixes h_/d_ + the draw.
if [ "$hash" = 1 ]; then
  $E create-table hbench --capacity "$rows" --emb-width 128 --dtype f32 \
    --optimizer rowwise_adagrad >/dev/null
  hkeys() { $E stats --json | /usr/bin/python3 -c 'import json,sys
print(next(t for t in json.load(sys.stdin)[0]["tables"] if t["name"] == "hbench")["keys"])'; }
  for _ in $(seq 60); do
    [ "$(hkeys)" -ge "$rows" ] && break
    $E bench hbench --batch 65536 --duration 1 --concurrency 1 --tokens uniform \
      --key-space $((10 * rows)) --push-ratio 1 --json >/dev/null
  done
  echo "embps hash table filled: $(hkeys) keys of capacity $rows"
  for dist in uniform zipf; do
    if [ "$dist" = "$tokens" ]; then
      for k in lookup4096 push4096 lookup65536 push65536; do
        for f in rows gbs p50 p99 scpu ccpu; do result[d_${dist}_${k}_$f]=${result[${k}_$f]}; done
      done
    else
      BTOKENS=$dist run_all "d_${dist}_"
    fi
    BTABLE=hbench BTOKENS=$dist BFLAGS="--key-space $((10 * rows))" run_all "h_${dist}_"
  done
  echo "embps hash table after the runs: $(hkeys) keys of capacity $rows"
fi

if [ "$perf" = 1 ] && command -v perf >/dev/null; then
  for ratio in 0 1; do
    for batch in 4096 65536; do
      ( $E bench bench --batch "$batch" --duration "$duration" --concurrency 1 --tokens "$tokens" \
          --push-ratio "$ratio" --json >/dev/null ) &
      bpid=$!
      sleep 1 # past the bench's warm-up
      perf record -g -o "$work/perf.data" -p "$spid" -- sleep "$((duration > 3 ? duration - 2 : 1))" >/dev/null 2>&1 || true
      wait $bpid || true
      echo "---- server profile ($([ "$ratio" = 1 ] && echo push || echo lookup) $batch x 128, $tokens tokens) ----"
      perf report -i "$work/perf.data" --no-children --percent-limit 2 --stdio 2>/dev/null | grep -E '^ +[0-9.]+%' | head -15 || true
    done
  done
fi

# ---- 3. embps, 2-rank shard group -------------------------------------------------------------
# The single server goes first so the group has the machine to itself.
kill "$spid" 2>/dev/null || true; wait "$spid" 2>/dev/null || true
# Two client ports and a peer-port offset that leaves both peer ports free too.
read -r gp0 gp1 goff < <(/usr/bin/python3 deploy/group_ports.py)
gpids=()
gpeers=127.0.0.1:$gp0,127.0.0.1:$gp1
for r in 0 1; do
  build/bin/embps-server --rank "$r" --peers "$gpeers" --peer-port-offset "$goff" \
    >"$work/group$r.log" 2>&1 &
  pids+=($!)
  gpids+=($!)
done
SERVER_PIDS="${gpids[*]}"
E="build/bin/embps --servers $gpeers"
up=0
for _ in $(seq 100); do
  $E --connect-timeout-ms 1000 --deadline-ms 2000 health >/dev/null 2>&1 && { up=1; break; }
  sleep 0.3
done
[ $up = 1 ] || { cat "$work"/group*.log; echo "the 2-rank group did not become healthy" >&2; exit 1; }
$E create-table bench --rows "$rows" --emb-width 128 --dtype f32 --optimizer rowwise_adagrad >/dev/null
NRANKS=2
run_all g2_
NRANKS=1

# The least a rank can send per batch: the other ranks' token shards (T/N tokens each) need
# its D/N columns, i.e. (T/N) x D x 4 bytes x (N-1)/N; a push moves the same gradient slices.
minb() { awk -v t="$1" -v n=2 -v d=128 'BEGIN{printf "%.0f", t/n*d*4*(n-1)/n}'; }
min4096=$(minb 4096); min65536=$(minb 65536)

# ---- 4. Redis MGET ----------------------------------------------------------------------------
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
declare -A redis_at
for P in 1 2; do
  redis_rows=()
  for _ in $(seq "$repeat"); do
    rps=$(redis-benchmark -p "$rport" -c 1 -P "$P" -n 400 -r "$rrows" --csv MGET "${keys[@]}" | tail -1 | cut -d, -f2 | tr -d '"')
    redis_rows+=("$(awk -v r="$rps" 'BEGIN{printf "%.0f", r*4096}')")
  done
  redis_at[$P]=$(printf '%s\n' "${redis_rows[@]}" | median)
  echo "redis MGET 4096 x 512 B, pipeline $P: ${redis_rows[*]} rows/s (median ${redis_at[$P]})"
done
redis=${redis_at[1]}

# ---- the table ---------------------------------------------------------------------------------
lk=${result[lookup4096_rows]}; lg=${result[lookup4096_gbs]}
awk -v ip="$iperf" -v ip128="${iperf_at[128K]}" -v ip1m="${iperf_at[1M]}" -v lg="$lg" -v lk="$lk" -v rd="$redis" \
    -v rd2="${redis_at[2]}" -v lk2="${result[lookup4096p2_rows]}" -v lg2="${result[lookup4096p2_gbs]}" \
    -v pr="${result[push4096_rows]}" \
    -v l65="${result[lookup65536_rows]}" -v g65="${result[lookup65536_gbs]}" -v p65="${result[push65536_rows]}" \
    -v lp="${result[lookup4096_p50]}" -v pp="${result[push4096_p50]}" -v lp99="${result[lookup4096_p99]}" \
    -v r4="${ref[4096]}" -v r65="${ref[65536]}" -v rt4="${ref[t4096]}" -v rt65="${ref[t65536]}" \
    -v rg4="${ref[g4096]}" -v rg65="${ref[g65536]}" \
    -v tok="$tokens" 'BEGIN {
  printf "\n(tokens %s over the table)\n", tok
  printf "\n%-44s %14s\n", "measurement (median)", "value"
  printf "%-44s %14.3f\n", "iperf3 single stream, 128 KiB writes, GB/s", ip128
  printf "%-44s %14.3f\n", "iperf3 single stream, 1 MiB writes, GB/s", ip1m
  printf "%-44s %14.3f\n", "raw TCP transfer, 4096-row reply, GB/s", rt4
  printf "%-44s %14.3f\n", "raw TCP transfer, 65536-row reply, GB/s", rt65
  printf "%-44s %14.3f\n", "plain raw-TCP lookup 4096, GB/s", r4
  printf "%-44s %14.3f\n", "plain raw-TCP lookup 65536, GB/s", r65
  printf "%-44s %14.3f\n", "row gather alone, one thread, 4096, GB/s", rg4
  printf "%-44s %14.3f\n", "row gather alone, one thread, 65536, GB/s", rg65
  printf "%-44s %14.0f\n", "embps lookup 4096x128 f32 rows/s", lk
  printf "%-44s %14.3f\n", "embps lookup 4096x128 f32 GB/s", lg
  printf "%-44s %14.3f\n", "embps lookup 4096x128 p50 ms", lp
  printf "%-44s %14.0f\n", "embps push 4096x128 rowwise_adagrad rows/s", pr
  printf "%-44s %14.3f\n", "embps push 4096x128 p50 ms", pp
  printf "%-44s %14.0f\n", "embps lookup 65536x128 f32 rows/s", l65
  printf "%-44s %14.3f\n", "embps lookup 65536x128 f32 GB/s", g65
  printf "%-44s %14.0f\n", "embps push 65536x128 rows/s", p65
  printf "%-44s %14.0f\n", "embps lookup 4096x128, 2 in flight, rows/s", lk2
  printf "%-44s %14.3f\n", "embps lookup 4096x128, 2 in flight, GB/s", lg2
  printf "%-44s %14.0f\n", "redis MGET 4096 x 512B rows/s", rd
  printf "%-44s %14.0f\n", "redis MGET 4096 x 512B, pipeline 2, rows/s", rd2
  printf "%-44s %13.1f%%  (target >= 70%%)\n", "lookup GB/s / iperf3 ceiling", 100*lg/ip
  printf "%-44s %13.1f%%  (target >= 70%%)\n", "lookup (2 in flight) GB/s / iperf3 ceiling", 100*lg2/ip
  printf "%-44s %13.1fx  (target >= 8x)\n", "lookup rows/s / redis rows/s", lk/rd
  printf "%-44s %13.1fx  (target >= 8x)\n", "same, both pipelined 2 deep", lk2/rd2
  printf "%-44s %13.2fx  (target <= 1.5x)\n", "push time / lookup time (4096)", lk/pr
  printf "\n%-44s %14s\n", "ratios (issue 13)", "value"
  printf "%-44s %13.1f%%\n", "lookup 4096, 1 in flight / iperf3 1 MiB", 100*lg/ip1m
  printf "%-44s %13.1f%%\n", "lookup 4096, 2 in flight / iperf3 1 MiB", 100*lg2/ip1m
  printf "%-44s %13.1f%%\n", "lookup 65536 / iperf3 1 MiB", 100*g65/ip1m
  printf "%-44s %13.2fx  (target >= 0.8x)\n", "push / lookup rows/s, 4096", pr/lk
  printf "%-44s %13.2fx  (target >= 0.8x)\n", "push / lookup rows/s, 65536", p65/l65
  printf "%-44s %13.2fx\n", "lookup 4096 p99 / p50, 1 in flight", lp99/lp
  printf "\n%-44s %14s\n", "the same lookups against raw TCP", "value"
  printf "%-44s %13.1f%%\n", "lookup 4096, 1 in flight / raw TCP transfer", 100*lg/rt4
  printf "%-44s %13.1f%%\n", "lookup 65536 / raw TCP transfer", 100*g65/rt65
  printf "%-44s %13.1f%%\n", "lookup 4096, 1 in flight / plain raw-TCP lookup", 100*lg/r4
  printf "%-44s %13.1f%%\n", "lookup 65536 / plain raw-TCP lookup", 100*g65/r65
}'
row2() { # LABEL KEY FORMAT
  awk -v l="$1" -v a="${result[$2]}" -v b="${result[g2_$2]}" -v f="$3" 'BEGIN {
    printf "%-44s " f " " f " %9.2fx\n", l, a, b, (a > 0 ? b / a : 0) }'
}
printf "\n%-44s %14s %14s %10s\n" "1 rank vs 2-rank group (median)" "1 rank" "2 ranks" "2 / 1"
row2 "embps lookup 4096x128 f32 rows/s" lookup4096_rows "%14.0f"
row2 "embps lookup 4096x128 f32 GB/s" lookup4096_gbs "%14.3f"
row2 "embps lookup 4096x128 p50 ms" lookup4096_p50 "%14.3f"
row2 "embps push 4096x128 rowwise_adagrad rows/s" push4096_rows "%14.0f"
row2 "embps push 4096x128 p50 ms" push4096_p50 "%14.3f"
row2 "embps lookup 65536x128 f32 rows/s" lookup65536_rows "%14.0f"
row2 "embps lookup 65536x128 f32 GB/s" lookup65536_gbs "%14.3f"
row2 "embps lookup 65536x128 p50 ms" lookup65536_p50 "%14.3f"
row2 "embps push 65536x128 rows/s" push65536_rows "%14.0f"
row2 "embps push 65536x128 p50 ms" push65536_p50 "%14.3f"

printf "\n%-44s %14s %14s %10s\n" "2-rank peer bytes sent per batch (max rank)" "measured" "minimum" "ratio"
peer_row() { # LABEL KEY MIN
  awk -v l="$1" -v m="${result[g2_${2}_peer]}" -v n="$3" 'BEGIN {
    printf "%-44s %14.0f %14.0f %9.3fx  (target <= 1.25x)\n", l, m, n, m / n }'
}
peer_row "lookup 4096x128 f32" lookup4096 "$min4096"
peer_row "push 4096x128 rowwise_adagrad" push4096 "$min4096"
peer_row "lookup 65536x128 f32" lookup65536 "$min65536"
peer_row "push 65536x128 rowwise_adagrad" push65536 "$min65536"

# The CPU a batch costs, and what it allows: with the bench and the server on the same cores,
# push rows/s can be at most cores x batch / (server + client CPU per push batch).
ncores=$(nproc)
printf "\n%-44s %10s %10s %10s %14s %10s\n" "CPU ms per batch, 1 rank (median)" "server" "client" \
  "total" "rows/s allowed" "/ lookup"
cpu_row() { # LABEL KEY BATCH LOOKUP_KEY
  awk -v l="$1" -v s="${result[${2}_scpu]}" -v c="${result[${2}_ccpu]}" -v b="$3" -v n="$ncores" \
      -v lk="${result[${4}_rows]}" 'BEGIN {
    cap = (s + c > 0) ? n * 1e3 / (s + c) * b : 0
    printf "%-44s %10.3f %10.3f %10.3f %14.0f %9.2fx\n", l, s, c, s + c, cap, (lk > 0 ? cap / lk : 0) }'
}
cpu_row "lookup 4096x128 f32" lookup4096 4096 lookup4096
cpu_row "push 4096x128 rowwise_adagrad" push4096 4096 lookup4096
cpu_row "lookup 65536x128 f32" lookup65536 65536 lookup65536
cpu_row "push 65536x128 rowwise_adagrad" push65536 65536 lookup65536
echo "(rows/s allowed: $ncores cores x batch / total CPU per batch, the most the machine's cores allow with client and server both on them; / lookup: that against the measured lookup rows/s at the same batch)"

if [ "$hash" = 1 ]; then
  printf "\n%-44s %14s %14s %10s\n" "hash (capacity = rows, keys 10x) vs dense" "dense rows/s" \
    "hash rows/s" "hash/dense"
  hash_row() { # LABEL KEY DIST
    awk -v l="$1 $3" -v d="${result[d_${3}_${2}_rows]}" -v h="${result[h_${3}_${2}_rows]}" 'BEGIN {
      printf "%-44s %14.0f %14.0f %9.2fx  (target >= 0.8x)\n", l, d, h, (d > 0 ? h / d : 0) }'
  }
  for dist in uniform zipf; do
    hash_row "lookup 4096x128" lookup4096 "$dist"
    hash_row "push 4096x128" push4096 "$dist"
    hash_row "lookup 65536x128" lookup65536 "$dist"
    hash_row "push 65536x128" push65536 "$dist"
  done
fi

if [ "$features" = 1 ]; then
  features_section
fi
