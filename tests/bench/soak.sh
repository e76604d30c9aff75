#!/usr/bin/env bash
# Soak benchmark (see tests/bench/soak.py for what it does and prints):
#   tests/bench/soak.sh [--minutes 30] [--ranks 2] [--clients 4] [--load 0.8] [--json FILE] ...
# Needs a built tree (build/bin/embps-server, or EMBPS_SERVER_BIN) and Debian's python3-grpcio
# and python3-numpy (deploy/packages.sh installs them).
set -euo pipefail
exec /usr/bin/python3 "$(dirname "$0")/soak.py" "$@"
