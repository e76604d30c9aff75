#!/usr/bin/env bash
# The whole test suite: installs what it needs from Debian's packages, builds, and runs every
# test with ctest.
#
#   tests/run.sh              release build (build/), every test
#   tests/run.sh --sanitize   AddressSanitizer + UBSan build (build-asan/), every test
#   tests/run.sh --all        both, then the clang-format check
#   tests/run.sh --format     only the clang-format check
set -euo pipefail
cd "$(dirname "$0")/.."

mode=release
case "${1:-}" in
  "") ;;
  --sanitize) mode=sanitize ;;
  --all) mode=all ;;
  --format) mode=format ;;
  -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
  *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
esac

deploy/packages.sh

jobs=$(nproc)

build_and_test() { # DIR CMAKE-ARGS...
  local dir=$1; shift
  cmake -S . -B "$dir" -DEMBPS_WERROR=ON "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
  ctest --test-dir "$dir" --output-on-failure -j "$jobs"
}

format_check() {
  local files
  files=$(git ls-files '*.c' '*.h' '*.cu' '*.cuh')
  if [ -n "$files" ]; then
    # shellcheck disable=SC2086
    clang-format --dry-run --Werror $files
    echo "clang-format: $(echo "$files" | wc -l) files clean"
  fi
}

case $mode in
  release) build_and_test build -DCMAKE_BUILD_TYPE=RelWithDebInfo ;;
  sanitize)
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    build_and_test build-asan -DCMAKE_BUILD_TYPE=Debug -DEMBPS_SANITIZE=address,undefined ;;
  all)
    build_and_test build -DCMAKE_BUILD_TYPE=RelWithDebInfo
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    build_and_test build-asan -DCMAKE_BUILD_TYPE=Debug -DEMBPS_SANITIZE=address,undefined
    format_check ;;
  format) format_check ;;
esac
