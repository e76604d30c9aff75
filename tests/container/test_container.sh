#!/usr/bin/env bash
# The container image, built and run: deploy/container/build.sh builds deploy/Dockerfile with
# buildah on a local Debian base (made with mmdebstrap when missing, cached after), then a 2-rank
# group runs as two podman containers on a podman network of their own, reaching each other by
# name (EMBPS_PEERS=embps-0:7070,embps-1:7070). From the host: gRPC health with stock grpcio
# (tests/interop/embps_testlib.py), a table created and used with the Python library, the CLI's
# bench, /metrics of both ranks; in the image: the embps CLI and the image's HEALTHCHECK. Then
# SIGTERM (podman stop) and both containers must exit 0.
#
# Prints "SKIP: ..." and exits 77 (ctest: skipped) where podman or buildah cannot run: tools
# missing, podman not working, the OCI runtime or the container network failing, or the Debian
# archive unreachable while the image has to be built. Only the containers, the network and the
# temporary folder this test creates are touched, and all go away on exit; the images stay
# (layer cache for the next run).
#
# Environment: EMBPS_CLI_BIN (the host's CLI), EMBPS_IMAGE (default localhost/embps:latest),
# EMBPS_OCI_RUNTIME (default runc), CONTAINER_TEST_NO_BUILD=1 (use the image as it is).
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cli_bin=${EMBPS_CLI_BIN:-$root/build/bin/embps}
image=${EMBPS_IMAGE:-localhost/embps:latest}
runtime=${EMBPS_OCI_RUNTIME:-runc}
python=/usr/bin/python3

tag=embps-ctest-$$
net=$tag
names=("$tag-0" "$tag-1")
work=$(mktemp -d /tmp/embps-container.XXXXXX)
t0=$SECONDS

log() { echo "[container +$((SECONDS - t0))s] $*"; }
skip() { echo "SKIP: $*"; exit 77; }
die() { echo "FAIL: $*"; exit 1; }

pod() { podman --runtime "$runtime" "$@"; }

dump_logs() {
  local n
  for n in "${names[@]}"; do
    echo "---- podman logs $n"
    pod logs "$n" 2>&1 | tail -n 60
  done
}

cleanup() {
  local n
  for n in "${names[@]}"; do pod rm -f -v -t 0 "$n" >/dev/null 2>&1; done
  pod network rm -f "$net" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ -x "$cli_bin" ] || die "no CLI binary at $cli_bin"
for t in podman buildah mmdebstrap "$runtime"; do
  command -v "$t" >/dev/null || skip "'$t' is not installed (deploy/packages.sh installs buildah podman mmdebstrap runc netavark aardvark-dns iptables)"
done
"$python" -c 'import grpc, grpc_tools, numpy' 2>/dev/null ||
  skip "python3-grpcio, python3-grpc-tools or python3-numpy missing (deploy/packages.sh)"
info=$(timeout 60 podman info --format '{{.Host.NetworkBackend}} {{.Store.GraphDriverName}}' 2>&1) ||
  skip "podman cannot run here: $(echo "$info" | tail -n 2 | tr '\n' ' ')"
log "podman $(podman version --format '{{.Client.Version}}' 2>/dev/null), buildah $(buildah version 2>/dev/null | awk '/^Version:/ {print $2}'), runtime $runtime, network backend and storage: $info"

# ulimits: the defaults (nofile 1048576) exceed what these hosts allow a container.
ulimits=(--ulimit nofile=20000:20000 --ulimit nproc=32768:32768)

# Can a container run at all? Asked of a local image, so no registry is needed.
probe_runtime() {
  local img=$1 out
  out=$(timeout 120 podman --runtime "$runtime" run --rm "${ulimits[@]}" --network none \
          --entrypoint /bin/true "$img" 2>&1) ||
    skip "podman cannot run a container here ($runtime): $(echo "$out" | tail -n 2 | tr '\n' ' ')"
}

# Is the Debian archive reachable (the image's build stage installs packages from it)?
archive_reachable() {
  "$python" - <<'EOF'
import re, sys, urllib.request
mirror = "http://deb.debian.org/debian"
try:
    for line in open("/etc/apt/sources.list.d/debian.sources"):
        m = re.match(r"URIs:\s*(\S+/debian)/?\s*$", line)
        if m:
            mirror = m.group(1)
            break
except OSError:
    pass
try:
    urllib.request.urlopen(mirror + "/dists/bookworm/InRelease", timeout=10).close()
except Exception as e:
    print(mirror, e)
    sys.exit(1)
EOF
}

base=localhost/embps-base:bookworm
base_probed=0
if podman image exists "$base"; then probe_runtime "$base"; base_probed=1; fi

if [ "${CONTAINER_TEST_NO_BUILD:-0}" = 1 ]; then
  podman image exists "$image" || die "CONTAINER_TEST_NO_BUILD=1 but there is no image $image"
  log "using $image as it is"
else
  log "building $image (deploy/container/build.sh; cached layers are reused)"
  if ! EMBPS_OCI_RUNTIME=$runtime "$root/deploy/container/build.sh" --tag "$image" >"$work/build.log" 2>&1; then
    [ $base_probed = 1 ] || { podman image exists "$base" && probe_runtime "$base"; }
    if why=$(archive_reachable); then
      tail -n 40 "$work/build.log"
      die "the image did not build (the Debian archive is reachable; log above)"
    fi
    tail -n 5 "$work/build.log"
    skip "the image cannot be built here: the Debian archive is unreachable ($why)"
  fi
  tail -n 1 "$work/build.log"
fi
[ $base_probed = 1 ] || probe_runtime "$image"
log "image: $(podman image inspect --format '{{.Id}}' "$image" | cut -c1-12), $(podman image inspect --format '{{.Size}}' "$image" | awk '{printf "%.1f MB", $1 / 1e6}')"

# Four free loopback ports: each rank's client and metrics ports, published on the host.
read -r c0 c1 m0 m1 < <("$python" - <<'EOF'
import socket
socks = []
for _ in range(4):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
print(*(s.getsockname()[1] for s in socks))
EOF
)
servers=127.0.0.1:$c0,127.0.0.1:$c1

out=$(pod network create "$net" 2>&1) || skip "podman cannot create a network here: $out"
log "network $net; rank 0 at $servers (client), metrics 127.0.0.1:$m0 and :$m1"
cports=("$c0" "$c1")
mports=("$m0" "$m1")
# The group secret, as deploy/ mounts it: a read-only file only the image's user (65534) reads.
head -c 32 /dev/urandom | base64 >"$work/group-secret"
chown 65534:65534 "$work/group-secret"
chmod 0400 "$work/group-secret"
for r in 0 1; do
  # The image's HEALTHCHECK stays, without podman's timer (a systemd unit, absent on hosts
  # without systemd); `podman healthcheck run` runs it below.
  out=$(pod run -d --name "${names[$r]}" "${ulimits[@]}" \
          --network "$net" --network-alias "embps-$r" --health-interval disable \
          -p "127.0.0.1:${cports[$r]}:7070" -p "127.0.0.1:${mports[$r]}:9100" \
          -e EMBPS_RANK=$r -e EMBPS_PEERS=embps-0:7070,embps-1:7070 \
          -v "$work/group-secret:/etc/embps/group-secret:ro" \
          -e EMBPS_GROUP_SECRET_FILE=/etc/embps/group-secret \
          -e EMBPS_MAX_MEMORY_BYTES=1G "$image" 2>&1) ||
    { dump_logs; skip "podman cannot run the container here: $(echo "$out" | tail -n 2 | tr '\n' ' ')"; }
done

# Health from the host with stock grpcio (generated stubs of proto/grpc/health/v1), bounded,
# while both containers still run.
PYTHONPATH=$root/tests/interop:$root/python EMBPS_CACHE_DIR=$work/pycache PYTHONDONTWRITEBYTECODE=1 \
  timeout 150 "$python" - "$c0" "$c1" "${names[@]}" >"$work/py.log" 2>&1 <<'EOF'
import subprocess, sys, time
import grpc
import numpy as np
import embps_testlib as tl

ports, names = sys.argv[1:3], sys.argv[3:5]
addrs = ["127.0.0.1:" + p for p in ports]
serving = tl.health_pb2.HealthCheckResponse.SERVING
deadline = time.time() + 120
left = list(addrs)
while left:
    for n in names:
        st = subprocess.run(["podman", "inspect", "--format", "{{.State.Status}}", n],
                            capture_output=True, text=True).stdout.strip()
        if st != "running":
            sys.exit("container %s is %s before the group served" % (n, st))
    if time.time() > deadline:
        sys.exit("not SERVING within 120 s: " + ", ".join(left))
    for a in list(left):
        with tl.channel(a) as ch:
            try:
                r = tl.health_pb2_grpc.HealthStub(ch).Check(tl.health_pb2.HealthCheckRequest(),
                                                            timeout=2)
                if r.status == serving:
                    left.remove(a)
            except grpc.RpcError:
                pass
    if left:
        time.sleep(0.5)
print("grpcio health: SERVING on", ", ".join(addrs))
EOF
rc=$?
cat "$work/py.log"
[ $rc = 0 ] || { dump_logs; die "gRPC health from the host failed (rc $rc)"; }
# The group formed with the secret: a rank without one, or one that every user may read, warns.
for n in "${names[@]}"; do
  if pod logs "$n" 2>&1 | grep -E "no --group-secret-file|group secret file .* has mode"; then
    dump_logs
    die "$n did not take the group secret as mounted"
  fi
done
log "both ranks formed the group with the mounted group secret"

# A table through the Python library (its own process: embps_testlib's generated stubs are a
# package named embps too).
PYTHONPATH=$root/python EMBPS_CACHE_DIR=$work/pycache PYTHONDONTWRITEBYTECODE=1 \
  timeout 60 "$python" - "$c0" "$c1" >"$work/py.log" 2>&1 <<'EOF'
import sys
import numpy as np
import embps
addrs = ["127.0.0.1:" + p for p in sys.argv[1:3]]
with embps.Client(",".join(addrs), timeout=30) as c:
    assert c.group_size == 2, c.group_size
    c.create_table("ctr", 100000, 64, optimizer="rowwise_adagrad", lr=0.1)
    before = c.lookup("ctr", np.array([1, 2, 3, 4]))
    r = c.push("ctr", [1, 2, 3, 4], np.ones((4, 64), np.float32))
    assert r.applied, r
    after = c.lookup("ctr", np.array([1, 2, 3, 4]))
    assert before.shape == (4, 64) and np.all(after < before), "push did not move the rows"
    print("python client: table ctr created, pushed and read back on", c.group_size, "ranks")
EOF
rc=$?
cat "$work/py.log"
[ $rc = 0 ] || { dump_logs; die "the table through the Python library failed (rc $rc)"; }

# The CLI inside the image, over the container network by name, and the image's HEALTHCHECK.
out=$(timeout 30 podman exec "${names[1]}" embps --servers embps-0:7070,embps-1:7070 \
        --connect-timeout-ms 5000 --deadline-ms 5000 health 2>&1) ||
  { echo "$out"; dump_logs; die "embps health inside the container failed"; }
log "in the image: embps health -> $(echo "$out" | tr '\n' ' ')"
out=$(timeout 30 podman healthcheck run "${names[0]}" 2>&1) ||
  { echo "$out"; die "the image's HEALTHCHECK failed: $out"; }
log "podman healthcheck run: healthy (the image's HEALTHCHECK, exit 0)"

# The host's CLI: a short bench over the published ports.
timeout 60 "$cli_bin" --servers "$servers" --connect-timeout-ms 5000 bench ctr --batch 1024 \
  --duration 2 --warmup 0.5 --concurrency 2 --zipf 1.05 --push-ratio 0.5 --json >"$work/bench.json" 2>&1 ||
  { cat "$work/bench.json"; dump_logs; die "embps bench failed"; }
"$python" - "$work/bench.json" <<'EOF' || { dump_logs; die "bench result"; }
import json, sys
b = json.load(open(sys.argv[1]))
print("[container] bench: %d lookups, %d pushes in %.2f s; %.0f rows/s looked up, p99 %.2f ms" %
      (b["lookups"], b["pushes"], b["duration_s"], b["lookup_rows_per_s"], b["p99_ms"]))
assert b["lookups"] > 0 and b["pushes"] > 0, "bench did no work"
EOF

# /metrics of both ranks, through the published ports.
"$python" - "$m0" "$m1" <<'EOF' || { dump_logs; die "/metrics"; }
import re, sys, urllib.request
for rank, port in enumerate(sys.argv[1:3]):
    text = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % port, timeout=10).read().decode()
    def value(series):
        m = re.search(r"^" + re.escape(series) + r" (\S+)$", text, re.M)
        assert m, "rank %d: no %s in /metrics" % (rank, series)
        return float(m.group(1))
    assert value("embps_group_rank") == rank
    assert value("embps_group_size") == 2
    assert value("embps_group_ready") == 1
    assert value('embps_table_lookups_total{table="ctr"}') > 0
    assert value('embps_table_pushes_total{table="ctr"}') > 0
    assert value("embps_group_peer_sent_bytes_total") > 0
    assert re.search(r'^grpc_server_handled_total\{[^}]*grpc_method="Lookup"[^}]*grpc_code="OK"[^}]*\} [1-9]',
                     text, re.M), "rank %d: no OK Lookup in grpc_server_handled_total" % rank
    print("[container] rank %d /metrics: %d lines, ready, lookups %d" %
          (rank, text.count("\n"), value('embps_table_lookups_total{table="ctr"}')))
EOF

# SIGTERM: both drain and exit 0 within the 30 s podman stop allows before SIGKILL.
log "podman stop -t 30 (SIGTERM)"
timeout 90 podman stop -t 30 "${names[@]}" >/dev/null 2>&1
codes=()
for n in "${names[@]}"; do
  codes+=("$(podman inspect --format '{{.State.ExitCode}}' "$n" 2>&1)")
done
log "exit codes: ${codes[*]}"
for r in 0 1; do
  [ "${codes[$r]}" = 0 ] || { dump_logs; die "rank $r exited ${codes[$r]} after SIGTERM, not 0"; }
done
pod logs "${names[0]}" 2>&1 | tail -n 3 | sed 's/^/[rank 0 log] /'
log "PASS ($((SECONDS - t0)) s)"
