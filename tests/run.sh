#!/usr/bin/env bash
# The whole test suite: installs what it needs from Debian's packages, builds, and runs every
# test with ctest.
#
#   tests/run.sh              release build (build/), every test
#   tests/run.sh --sanitize   AddressSanitizer + UBSan build (build-asan/), every test
#   tests/run.sh --tsan       ThreadSanitizer build (build-tsan/), every test; any report fails
#   tests/run.sh --all        all three, then the clang-format check
#   tests/run.sh --format     only the clang-format check
#   tests/run.sh --fuzz SECONDS
#                             libFuzzer build (build-fuzz/, clang), then each fuzz target for
#                             SECONDS over a copy of its corpus (FUZZ_TARGETS="fuzz_h2conn ..."
#                             picks some); prints execs, coverage and crashes per target and
#                             fails on any crash, keeping the input (tests/fuzz/README.md)
#   tests/run.sh --scale [N...]
#                             release build (build/), then the scale tests (ctest label scale,
#                             left out of every other mode): groups of N ranks on loopback
#                             (16 and 32 by default; .ci/run runs 16), printing formation time,
#                             rounds/s, fds, threads and RSS per rank (test_group_scale.py)
set -euo pipefail
cd "$(dirname "$0")/.."

mode=release
case "${1:-}" in
  "") ;;
  --sanitize) mode=sanitize ;;
  --tsan) mode=tsan ;;
  --all) mode=all ;;
  --format) mode=format ;;
  --fuzz)
    mode=fuzz
    fuzz_seconds=${2:-}
    case $fuzz_seconds in
      ''|*[!0-9]*) echo "--fuzz needs a number of seconds per target" >&2; exit 2 ;;
    esac ;;
  --scale)
    mode=scale
    shift
    scale_ranks=${*:-16 32}
    for n in $scale_ranks; do
      case $n in
        16|32) ;;
        *) echo "--scale takes group sizes among 16 and 32, not '$n'" >&2; exit 2 ;;
      esac
    done ;;
  -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
  *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
esac

deploy/packages.sh

jobs=$(nproc)

build_and_test() { # DIR CMAKE-ARGS...
  local dir=$1; shift
  cmake -S . -B "$dir" -DEMBPS_WERROR=ON "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" -LE scale
}

# The scale tests one at a time (each starts up to 32 ranks and wants the machine to itself);
# their figures (the "scale N=" lines) are printed again at the end.
scale_run() {
  local dir=build names="" n rc=0 log
  cmake -S . -B "$dir" -DEMBPS_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$dir" -j "$jobs" --target embps-server embps
  for n in $scale_ranks; do names="$names|scale_$n"; done
  log=$dir/scale.log
  ctest --test-dir "$dir" --output-on-failure -V -L scale -R "^(${names#|})\$" >"$log" 2>&1 || rc=$?
  grep -E 'Test +#|tests passed|tests failed|FAIL|Error' "$log" || true
  grep -o 'scale N=.*' "$log" || true
  [ "$rc" -eq 0 ] || { echo "scale tests failed; the whole output is in $log" >&2; tail -60 "$log" >&2; }
  return $rc
}

# The suite under ThreadSanitizer, built -O2 -g (RelWithDebInfo) as TSan's documentation
# advises. The CUDA backend is off: the CUDA runtime is not instrumented, so TSan cannot see its
# synchronisation; the CUDA engine's orchestration still runs on the simulated runtime
# (tests/unit/engine_sim), which is plain C and instrumented. Every process the tests start
# (test binaries, servers, the CLI) writes its reports to build-tsan/tsan-reports/report.PID
# and halts at the first one with exit code 66; a harness that does not look at a server's exit
# status (a rank a test kills, say) cannot hide one, since any report file fails the pass here.
tsan_pass() {
  local dir=build-tsan rc=0 reports
  reports=$PWD/$dir/tsan-reports
  cmake -S . -B "$dir" -DEMBPS_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DEMBPS_SANITIZE=thread -DEMBPS_CUDA=OFF >/dev/null
  cmake --build "$dir" -j "$jobs"
  rm -rf "$reports"
  mkdir -p "$reports"
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:log_path=$reports/report:suppressions=$PWD/tests/tsan.supp" \
    ctest --test-dir "$dir" --output-on-failure -j "$jobs" -LE scale || rc=$?
  if [ -n "$(ls -A "$reports")" ]; then
    for f in "$reports"/*; do
      echo "==== $f"
      cat "$f"
    done
    echo "ThreadSanitizer: $(ls "$reports" | wc -l) process(es) reported (above)" >&2
    rc=1
  fi
  return $rc
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

# Runs every fuzz target for $1 seconds, one at a time (libFuzzer uses one core each). Each works
# on build-fuzz/fuzz/<target>/corpus, which keeps what earlier runs found and gets the committed
# corpus copied in; crash inputs land in build-fuzz/fuzz/<target>/crashes/.
fuzz_run() {
  local seconds=$1 dir=build-fuzz failed=0 targets t
  CC=clang cmake -S . -B "$dir" -DEMBPS_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DEMBPS_FUZZ=ON -DEMBPS_CUDA=OFF >/dev/null
  cmake --build "$dir" -j "$jobs" --target embps_fuzz
  targets=${FUZZ_TARGETS:-$(cd tests/fuzz/corpus && ls)}
  printf '%-20s %12s %9s %8s %8s %7s %s\n' target execs exec/s cov ft corpus crashes
  for t in $targets; do
    local work=$dir/fuzz/$t log dict=() execs rate cov ft corp crashes
    log=$work/fuzz.log
    mkdir -p "$work/corpus" "$work/crashes"
    cp -rn "tests/fuzz/corpus/$t/." "$work/corpus/"
    [ -f "tests/fuzz/$t.dict" ] && dict=(-dict="tests/fuzz/$t.dict")
    set +e
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      "$dir/bin/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$work/crashes/" "${dict[@]}" "$work/corpus" \
      >"$log" 2>&1
    local rc=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
    ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
    corp=$(find "$work/corpus" -type f | wc -l)
    crashes=$(find "$work/crashes" -type f | wc -l)
    printf '%-20s %12s %9s %8s %8s %7s %s\n' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" \
      "${ft:-?}" "$corp" "$crashes"
    if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
      failed=1
      echo "$t: FAILED (exit $rc); its log: $log" >&2
      find "$work/crashes" -type f -printf '  crash input: %p\n' >&2
      grep -m1 -A12 'ERROR: \|runtime error\|deadly signal' "$log" >&2 || tail -20 "$log" >&2
    fi
  done
  return $failed
}

case $mode in
  fuzz) fuzz_run "$fuzz_seconds" ;;
  release) build_and_test build -DCMAKE_BUILD_TYPE=RelWithDebInfo ;;
  sanitize)
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    build_and_test build-asan -DCMAKE_BUILD_TYPE=Debug -DEMBPS_SANITIZE=address,undefined ;;
  tsan) tsan_pass ;;
  all)
    build_and_test build -DCMAKE_BUILD_TYPE=RelWithDebInfo
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    build_and_test build-asan -DCMAKE_BUILD_TYPE=Debug -DEMBPS_SANITIZE=address,undefined
    tsan_pass
    format_check ;;
  format) format_check ;;
  scale) scale_run ;;
esac
