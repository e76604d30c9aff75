#!/bin/sh
# Container entrypoint: the server reads its whole configuration from EMBPS_* variables
# (embps-server --help lists them), so this only picks the binary and passes extra flags on.
# A container listens on every interface unless EMBPS_LISTEN says otherwise.
#
# A StatefulSet (deploy/k8s/) sets two variables of this script's own instead of EMBPS_RANK and
# EMBPS_PEERS, so that the group size is one number:
#   EMBPS_REPLICAS      the group size N; the rank is the ordinal suffix of the host name
#                       (pod embps-2 is rank 2) unless EMBPS_RANK is set, and the peer list is
#                       STEM-0.DOMAIN:PORT,...,STEM-(N-1).DOMAIN:PORT (STEM: the host name less its
#                       ordinal, PORT: EMBPS_LISTEN's)
#   EMBPS_PEER_DOMAIN   DOMAIN above: the headless Service's name, e.g.
#                       embps-headless.NAMESPACE.svc.cluster.local
# Neither is a server setting; they are removed before the server starts. Without
# EMBPS_REPLICAS nothing changes (podman, docker, compose set EMBPS_RANK and EMBPS_PEERS).
set -eu
: "${EMBPS_LISTEN:=0.0.0.0:7070}"
export EMBPS_LISTEN
if [ -n "${EMBPS_REPLICAS:-}" ]; then
  die() { echo "embps-entrypoint: $*" >&2; exit 2; }
  case $EMBPS_REPLICAS in '' | *[!0-9]*) die "EMBPS_REPLICAS must be a number, not '$EMBPS_REPLICAS'" ;; esac
  [ "$EMBPS_REPLICAS" -ge 1 ] || die "EMBPS_REPLICAS must be at least 1"
  [ -z "${EMBPS_PEERS:-}" ] || die "set EMBPS_REPLICAS or EMBPS_PEERS, not both"
  [ -n "${EMBPS_PEER_DOMAIN:-}" ] || die "EMBPS_REPLICAS needs EMBPS_PEER_DOMAIN (the headless Service's name)"
  host=${HOSTNAME:-$(cat /proc/sys/kernel/hostname)}
  host=${host%%.*}
  ordinal=${host##*-}
  stem=${host%-*}
  case $ordinal in '' | *[!0-9]*) die "host name '$host' does not end in -ORDINAL (a StatefulSet pod's does)" ;; esac
  [ "$stem" != "$host" ] || die "host name '$host' does not end in -ORDINAL (a StatefulSet pod's does)"
  [ "$ordinal" -lt "$EMBPS_REPLICAS" ] || die "pod ordinal $ordinal is outside the $EMBPS_REPLICAS-rank group (EMBPS_REPLICAS and the StatefulSet's replicas must agree)"
  port=${EMBPS_LISTEN##*:}
  peers= i=0
  while [ "$i" -lt "$EMBPS_REPLICAS" ]; do
    peers=${peers:+$peers,}$stem-$i.$EMBPS_PEER_DOMAIN:$port
    i=$((i + 1))
  done
  : "${EMBPS_RANK:=$ordinal}"
  EMBPS_PEERS=$peers
  export EMBPS_RANK EMBPS_PEERS
  unset EMBPS_REPLICAS EMBPS_PEER_DOMAIN
fi
bin=${EMBPS_SERVER_BIN:-$(command -v embps-server || echo /usr/local/bin/embps-server)}
exec "$bin" "$@"
