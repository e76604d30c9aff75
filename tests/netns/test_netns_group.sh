#!/usr/bin/env bash
# Multi-host test of the shard group without containers: every rank runs in its own network
# namespace, started exactly as a container starts it (deploy/entrypoint.sh with EMBPS_RANK and
# EMBPS_PEERS, EMBPS_LISTEN left to the entrypoint's 0.0.0.0:7070). The rank namespaces hang off
# a bridge in a hub namespace by one veth pair each; the CLI runs in the hub.
#
#   rank R: namespace embps-<pid>-rR, address 198.18.0.(R+1)/24, clients :7070, peers :8070
#   hub:    namespace embps-<pid>-hub, bridge br0 at 198.18.0.254/24
#
# Only namespaces and links this test creates are touched, and all of them go away on exit.
# Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN); without it prints "SKIP: ..." and exits 77 (ctest
# counts that as skipped, not passed).
#
# Environment: EMBPS_SERVER_BIN, EMBPS_CLI_BIN (the binaries under test);
#              NETNS_GROUP_SIZES (default "2 3": the group sizes to run).
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
server_bin=${EMBPS_SERVER_BIN:-$root/build/bin/embps-server}
cli_bin=${EMBPS_CLI_BIN:-$root/build/bin/embps}
entrypoint=$root/deploy/entrypoint.sh
sizes=${NETNS_GROUP_SIZES:-"2 3"}

tag=embps-$$
hub=$tag-hub
work=$(mktemp -d /tmp/embps-netns.XXXXXX)
pids=()
namespaces=()
failed=0

log() { echo "[netns] $*"; }

cleanup() {
  local p ns
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  pids=()
  # Deleting a namespace destroys the veth ends inside it and so the whole pair.
  for ns in "${namespaces[@]}"; do ip netns del "$ns" 2>/dev/null; done
  namespaces=()
}
on_exit() { cleanup; rm -rf "$work"; }
trap on_exit EXIT
trap 'exit 130' INT TERM

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; failed=1; }

[ -x "$server_bin" ] || { echo "FAIL: no server binary at $server_bin"; exit 1; }
[ -x "$cli_bin" ] || { echo "FAIL: no CLI binary at $cli_bin"; exit 1; }
[ -x "$entrypoint" ] || { echo "FAIL: $entrypoint is not executable"; exit 1; }
command -v ip >/dev/null || skip "iproute2 ('ip') is not installed"
[ "$(id -u)" = 0 ] || skip "network namespaces need root (uid $(id -u))"
# The hub: a bridge every rank's veth joins, and the CLI's address.
setup_hub() {
  if ! ip netns add "$hub" 2>"$work/netns.err"; then
    skip "ip netns add is not permitted here: $(cat "$work/netns.err")"
  fi
  namespaces+=("$hub")
  if ! ip -n "$hub" link add br0 type bridge 2>"$work/br.err"; then
    skip "cannot create a bridge in a network namespace: $(cat "$work/br.err")"
  fi
  ip -n "$hub" link set lo up
  ip -n "$hub" addr add 198.18.0.254/24 dev br0
  ip -n "$hub" link set br0 up
}

hubx() { ip netns exec "$hub" "$@"; }
# The CLI in the hub; every call bounded.
E() { hubx timeout 60 "$cli_bin" --connect-timeout-ms 2000 --deadline-ms 20000 --servers "$servers" "$@"; }
jpy() { /usr/bin/python3 -c "$1" "${@:2}"; }

run_group() { # N
  local n=$1 r ns peers="" addr
  log "---- $n-rank group ----"
  setup_hub
  for r in $(seq 0 $((n - 1))); do
    peers+="${peers:+,}198.18.0.$((r + 1)):7070"
  done
  servers=$peers
  for r in $(seq 0 $((n - 1))); do
    ns=$tag-n$n-r$r
    ip netns add "$ns" || { fail "ip netns add $ns"; return; }
    namespaces+=("$ns")
    ip link add eth0 netns "$ns" type veth peer name "v$n-$r" netns "$hub" ||
      { fail "veth for rank $r"; return; }
    ip -n "$hub" link set "v$n-$r" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "198.18.0.$((r + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
  # Start every rank as a container would.
  for r in $(seq 0 $((n - 1))); do
    ns=$tag-n$n-r$r
    ip netns exec "$ns" env -u EMBPS_LISTEN EMBPS_RANK="$r" EMBPS_PEERS="$peers" \
      EMBPS_SERVER_BIN="$server_bin" EMBPS_BOOTSTRAP_TIMEOUT_MS=60000 \
      "$entrypoint" >"$work/n$n-r$r.log" 2>&1 &
    pids+=($!)
  done
  for r in $(seq 0 $((n - 1))); do
    addr=""
    for _ in $(seq 100); do
      addr=$(grep -o 'listening on [0-9.]*:[0-9]*' "$work/n$n-r$r.log" | head -1 | awk '{print $3}')
      [ -n "$addr" ] && break
      sleep 0.1
    done
    [ "$addr" = "0.0.0.0:7070" ] || { fail "rank $r listens on '$addr', expected the entrypoint's 0.0.0.0:7070"; cat "$work/n$n-r$r.log"; return; }
  done

  # health: every rank SERVING within a bounded wait.
  local ok=0
  for _ in $(seq 60); do
    if E health >"$work/health.out" 2>&1; then ok=1; break; fi
    sleep 0.5
  done
  if [ $ok != 1 ]; then
    fail "$n-rank group never became healthy: $(cat "$work/health.out")"
    for r in $(seq 0 $((n - 1))); do echo "--- rank $r log"; cat "$work/n$n-r$r.log"; done
    return
  fi
  log "health: $(tr '\n' ' ' <"$work/health.out")"
  for r in $(seq 0 $((n - 1))); do
    hubx timeout 30 "$cli_bin" --connect-timeout-ms 2000 --servers "198.18.0.$((r + 1)):7070" health >/dev/null 2>&1 ||
      fail "rank $r (198.18.0.$((r + 1)):7070) does not answer health on its own"
  done

  # One table, a lookup, a push, the lookup again.
  local width=$((8 * n)) tokens
  tokens=$(seq -s, 1 $((2 * n)))
  E create-table t$n --rows 10000 --emb-width "$width" --optimizer sgd --lr 0.5 >"$work/create.out" 2>&1 ||
    { fail "create-table: $(cat "$work/create.out")"; return; }
  log "$(cat "$work/create.out")"
  E tables >"$work/tables.out" 2>&1 && grep -q "t$n" "$work/tables.out" || fail "tables does not list t$n: $(cat "$work/tables.out")"
  E lookup "t$n" --tokens "$tokens" >"$work/before.out" 2>&1 || { fail "lookup: $(cat "$work/before.out")"; return; }
  E push "t$n" --tokens "$tokens" --grad-value 1 >"$work/push.out" 2>&1 || { fail "push: $(cat "$work/push.out")"; return; }
  log "push: $(cat "$work/push.out")"
  grep -q 'applied=1' "$work/push.out" || fail "push not applied: $(cat "$work/push.out")"
  E lookup "t$n" --tokens "$tokens" >"$work/after.out" 2>&1 || { fail "lookup after push: $(cat "$work/after.out")"; return; }
  # SGD, lr 0.5, gradient 1 everywhere: every value moves down by exactly 0.5.
  if ! jpy '
import sys
b = [l.split() for l in open(sys.argv[1])]; a = [l.split() for l in open(sys.argv[2])]
n, w = int(sys.argv[3]), int(sys.argv[4])
assert len(b) == len(a) == 2 * n, (len(b), len(a))
for x, y in zip(b, a):
    assert x[0] == y[0] and len(x) == len(y) == w + 1, (x[:2], y[:2])
    for u, v in zip(x[1:], y[1:]):
        assert abs((float(u) - 0.5) - float(v)) < 1e-5, (x[0], u, v)
' "$work/before.out" "$work/after.out" "$n" "$width" 2>"$work/cmp.err"; then
    fail "lookup after push does not show the update: $(tail -2 "$work/cmp.err")"
    head -2 "$work/before.out" "$work/after.out"
  else
    log "lookup after push: all $((2 * n)) x $width values moved by -0.5 on every rank's columns"
  fi

  # A short load across the group so peer traffic is not trivial.
  E bench "t$n" --batch $((1024 * n)) --duration 1 --warmup 0 --zipf 1.05 --push-ratio 0.5 --json \
    >"$work/bench.out" 2>&1 || fail "bench: $(cat "$work/bench.out")"

  # stats --json: every rank ready, same mesh, peer bytes both ways.
  E stats --json >"$work/stats.out" 2>&1 || { fail "stats: $(cat "$work/stats.out")"; return; }
  if ! jpy '
import json, sys
s = json.load(open(sys.argv[1])); n = int(sys.argv[2])
assert len(s) == n, "stats has %d ranks" % len(s)
for i, r in enumerate(s):
    assert r["rank"] == i and r["group_size"] == n, r
    assert r["ready"] is True, "rank %d not ready" % i
    assert r["mesh"] == "shard=%d" % n, r["mesh"]
    assert r["peer_bytes_sent"] > 0 and r["peer_bytes_received"] > 0, "rank %d peer bytes %r/%r" % (i, r["peer_bytes_sent"], r["peer_bytes_received"])
    print("[netns] rank %d: ready=%s mesh=%s peer_bytes_sent=%d peer_bytes_received=%d" % (i, r["ready"], r["mesh"], r["peer_bytes_sent"], r["peer_bytes_received"]))
' "$work/stats.out" "$n" 2>"$work/stats.err"; then
    fail "stats --json: $(tail -1 "$work/stats.err")"
    cat "$work/stats.out"
  fi
  for r in $(seq 0 $((n - 1))); do
    grep -q 'the group is ready' "$work/n$n-r$r.log" || fail "rank $r never logged 'the group is ready'"
  done

  [ $failed = 0 ] && log "$n-rank group across namespaces: OK"
}

for n in $sizes; do
  [ $failed = 0 ] || break
  run_group "$n"   # sets up the hub and the rank namespaces, and tears all of them down
  cleanup
done

if [ $failed = 0 ]; then
  echo "PASS: shard groups of size(s) $sizes across network namespaces"
  exit 0
fi
echo "FAIL: see above"
exit 1
