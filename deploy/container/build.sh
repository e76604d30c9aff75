#!/usr/bin/env bash
# Builds the embps image without a registry: a Debian 12 base made with mmdebstrap from the
# Debian archive (only when it is not there yet), imported as localhost/embps-base:bookworm, then
# deploy/Dockerfile built on it with buildah, tagged localhost/embps:latest. Runs as root (or
# wherever buildah and podman work); needs Debian's buildah, podman, mmdebstrap, runc, netavark,
# aardvark-dns and iptables (deploy/packages.sh installs them).
#
#   deploy/container/build.sh [--tag IMAGE] [--rebuild-base] [--network host] [BUILDAH ARGS...]
#
# --rebuild-base makes the base again (a fresh Debian point release); --network host builds with
# the host's network, where the containers' own network does not reach the archive. The Debian
# mirror is EMBPS_DEBIAN_MIRROR, else the first deb.debian.org-style URI in this host's apt
# sources, else http://deb.debian.org/debian. Arguments after the options go to `buildah bud`.
#
# The same image with docker, where a registry is reachable (Docker Hub's debian:12 as the base):
#   docker build -f deploy/Dockerfile --build-arg BASE=debian:12 -t embps:latest .
set -euo pipefail
cd "$(dirname "$0")/../.."

tag=localhost/embps:latest
base=${EMBPS_BASE_IMAGE:-localhost/embps-base:bookworm}
rebuild_base=0
network=()
while [ $# -gt 0 ]; do
  case $1 in
    --tag) tag=$2; shift 2 ;;
    --rebuild-base) rebuild_base=1; shift ;;
    --network) network=(--network "$2"); shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

# The host's Debian mirror (deb822 .sources or one-line .list), so the base and the image's apt
# use the archive this host reaches.
host_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -r "$f" ] || continue
    sed -nE -e 's/^URIs:[[:space:]]*([^[:space:]]+).*/\1/p' \
            -e 's/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+)[[:space:]]+bookworm[[:space:]].*/\2/p' "$f"
  done | grep -E '/debian/?$' | head -n1
}
mirror=${EMBPS_DEBIAN_MIRROR:-$(host_mirror || true)}
mirror=${mirror:-http://deb.debian.org/debian}
mirror=${mirror%/}
security=${EMBPS_DEBIAN_SECURITY_MIRROR:-${mirror%/debian}/debian-security}

if [ $rebuild_base = 1 ] || ! podman image exists "$base"; then
  echo "build.sh: making the base image $base with mmdebstrap from $mirror"
  tmp=$(mktemp -d /tmp/embps-base.XXXXXX)
  trap 'rm -rf "$tmp"' EXIT
  # Without manuals, translations and documentation but the copyright files, as debian:12-slim
  # (the dpkg options stay in the image, so packages installed on it leave them out too).
  # The merged-usr hook merges /usr by symlinks, without the usrmerge package (and the perl it
  # pulls in, 50 MB).
  hooks=()
  [ ! -d /usr/share/mmdebstrap/hooks/merged-usr ] ||
    hooks=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)
  mmdebstrap --variant=minbase --quiet "${hooks[@]}" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    bookworm "$tmp/base.tar" \
    "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
    "deb $security bookworm-security main"
  podman import --change 'CMD ["/bin/bash"]' --message "mmdebstrap --variant=minbase bookworm" \
    "$tmp/base.tar" "$base" >/dev/null
  rm -rf "$tmp"
  trap - EXIT
fi

# --format docker keeps the HEALTHCHECK (OCI images have no field for it); --layers caches each
# step, so a rebuild after a source edit repeats only the compile and what follows.
echo "build.sh: building $tag on $base"
# runc and lower ulimits: crun and the default ulimits fail on some hosts (cgroup v1, a low hard
# nofile limit).
buildah bud --runtime "${EMBPS_OCI_RUNTIME:-runc}" --ulimit nofile=20000:20000 --ulimit nproc=32768:32768 \
  --format docker --layers --build-arg "BASE=$base" "${network[@]}" \
  -f deploy/Dockerfile -t "$tag" "$@" .
podman image inspect --format '{{.Id}} {{.Size}}' "$tag" |
  awk -v t="$tag" '{printf "build.sh: %s is %.12s, %.1f MB\n", t, $1, $2 / 1e6}'
