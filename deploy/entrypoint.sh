#!/bin/sh
# Container entrypoint: the server reads its whole configuration from EMBPS_* variables
# (embps-server --help lists them), so this only picks the binary and passes extra flags on.
# A container listens on every interface unless EMBPS_LISTEN says otherwise.
set -eu
: "${EMBPS_LISTEN:=0.0.0.0:7070}"
export EMBPS_LISTEN
bin=${EMBPS_SERVER_BIN:-$(command -v embps-server || echo /usr/local/bin/embps-server)}
exec "$bin" "$@"
