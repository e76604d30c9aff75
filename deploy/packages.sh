#!/usr/bin/env bash
# Installs the Debian packages embps needs to build, test and benchmark, skipping those already
# present (so a machine without network access that has them still works). Sourced or run.
set -euo pipefail

EMBPS_PACKAGES=(
  build-essential cmake pkg-config git
  clang libclang-rt-14-dev
  libuv1-dev libnghttp2-dev libprotobuf-c-dev protobuf-c-compiler libcmocka-dev libisal-dev
  libmicrohttpd-dev libxxhash-dev xxhash python3-xxhash libjansson-dev
  libssl-dev openssl
  python3 python3-grpcio python3-grpc-tools python3-numpy python3-protobuf protobuf-compiler
  python3-torch
  iproute2 iperf3 redis-server redis-tools clang-format prometheus linux-perf
  python3-yaml python3-kubernetes python3-h2
  buildah podman mmdebstrap runc netavark aardvark-dns iptables
)

missing=()
for p in "${EMBPS_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
