#!/usr/bin/env bash
# The GPU machine's one check: build with CUDA, test the kernels against the CPU, run the server
# end to end on the GPU, measure the kernels. Run from the repo root; needs nothing from the
# network and finishes within EMBPS_GPU_BUDGET_S seconds (default 450, under 8 minutes).
#
#   tests/gpu/check.sh
#
# Steps, each under its own timeout (and never past the overall budget):
#   deps       libuv, nghttp2, protobuf-c (+ protoc-c), cmocka, pkg-config: when one is missing,
#              the .deb files in $EMBPS_GPU_DEBS (default .gpu-debs/, made here by
#              tests/gpu/fetch_debs.sh and carried along) are unpacked into a private prefix
#              ($EMBPS_GPU_DEPS_PREFIX, default /tmp/embps-deps) and the build pointed there
#   configure  cmake -DEMBPS_CUDA=ON into $EMBPS_GPU_BUILD (default build-gpu/); warnings are not
#              errors there unless EMBPS_GPU_WERROR=ON (an unknown host compiler must not stop
#              a GPU run over a new warning)
#   build      everything, -j$(nproc)
#   ctest      ctest -L gpu --output-on-failure (GPU kernels against their CPU references)
#   e2e        tests/gpu/e2e_cuda.sh: a 1-rank group with --device cuda:N through the real server
#              and CLI (health, create-table, lookup, push, lookup, stats, bench); SKIP while the
#              server has no CUDA backend
#   bench      bench_kernels_gpu $EMBPS_BENCH_FLAGS (copy ceiling, dedup, gather, rowwise
#              Adagrad, bag pooling and expansion at widths 128 and 1024, f32 and bf16, and f32
#              segment sum)
# and prints a summary last: PASS/FAIL/SKIP per step, then the benchmark's and e2e's numbers.
# Device: $EMBPS_GPU_DEVICE, a number (default 0); the server gets --device cuda:N. Exit status: 0 when no step failed (SKIPs are fine), else 1.
# Where $OUT is set (the device tool's output folder), the full log, the summary, the build log,
# the benchmark's output and the e2e results are copied there (also after each step, so a run
# cut short still brings back what it did).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
BUILD=${EMBPS_GPU_BUILD:-$ROOT/build-gpu}
DEBS=${EMBPS_GPU_DEBS:-$ROOT/.gpu-debs}
DEPS_PREFIX=${EMBPS_GPU_DEPS_PREFIX:-/tmp/embps-deps}
BUDGET=${EMBPS_GPU_BUDGET_S:-450}
WERROR=${EMBPS_GPU_WERROR:-OFF}
export EMBPS_GPU_DEVICE=${EMBPS_GPU_DEVICE:-0}
BENCH_FLAGS=${EMBPS_BENCH_FLAGS:-}
WORK=$(mktemp -d /tmp/embps-gpu-check.XXXXXX)
LOG=$WORK/check.log
START=$SECONDS

# shellcheck source=tests/gpu/debs_env.sh
. "$ROOT/tests/gpu/debs_env.sh"

STEPS=()
declare -A RESULT=() SECS=() NOTE=()

record() { # record STEP RESULT SECONDS NOTE
  STEPS+=("$1")
  RESULT[$1]=$2
  SECS[$1]=$3
  NOTE[$1]=$4
  echo ">>> $1: $2 (${3}s)${4:+ - $4}"
  copy_out
}

# Seconds a step may take: its own limit, cut to what is left of the budget.
limit() {
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

# run_step NAME TIMEOUT CMD...: runs CMD under timeout; sets RC (124: timed out).
run_step() {
  local name=$1 t
  t=$(limit "$2")
  shift 2
  echo
  echo "=== $name (timeout ${t}s): $*"
  if [ "$t" -lt 5 ]; then
    # An explicit status: a bare `return` would give the assignment's 0, and the steps that
    # run in a pipeline (ctest, e2e, bench) read PIPESTATUS, not RC, so they would pass.
    RC=125
    return 125
  fi
  timeout -k 10 "$t" "$@"
  RC=$?
  return "$RC"
}

# why RC: a note for a failed step's exit status.
why() {
  case $1 in
  124 | 137) echo "rc $1 (timed out)" ;;
  125) echo "no time left in the ${BUDGET}s budget" ;;
  *) echo "rc $1" ;;
  esac
}

copy_out() {
  [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] || return 0
  local f
  for f in "$LOG" "$WORK/summary.txt" "$WORK/build.log" "$WORK/bench.txt" "$WORK/e2e.txt"; do
    [ -f "$f" ] && cp -f "$f" "$OUT/" 2>/dev/null
  done
  # The e2e folder's interesting files, in one (8 files at most come back).
  if [ -d "$WORK/e2e" ]; then
    (cd "$WORK/e2e" && for f in bench-*.json stats-*.json server-*.log; do
      [ -f "$f" ] && printf '==> %s <==\n' "$f" && cat "$f" && echo
    done) >"$OUT/e2e-files.txt" 2>/dev/null
  fi
  return 0
}

main() {
  echo "embps GPU check: $(git -C "$ROOT" log -1 --format='%h %s' 2>/dev/null | cut -c1-100)"
  echo "host: $(uname -srm), $(nproc) CPUs; build dir $BUILD; device $EMBPS_GPU_DEVICE; budget ${BUDGET}s"
  command -v nvidia-smi >/dev/null 2>&1 &&
    timeout 20 nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version,clocks.sm,clocks.mem \
      --format=csv 2>&1 | sed 's/^/  /'

  # ---- (a) dependencies -------------------------------------------------------------------
  local t0=$SECONDS missing=() m note=""
  find_missing() {
    missing=()
    command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
    for m in libuv libnghttp2 libprotobuf-c cmocka libisal libmicrohttpd openssl libxxhash; do
      command -v pkg-config >/dev/null 2>&1 && pkg-config --exists "$m" 2>/dev/null || missing+=("$m")
    done
    command -v protoc-c >/dev/null 2>&1 || missing+=(protoc-c)
  }
  echo
  echo "=== deps"
  find_missing
  if [ ${#missing[@]} -eq 0 ] && [ -z "${EMBPS_GPU_FORCE_DEBS:-}" ]; then
    note="all from the system"
  else
    echo "missing: ${missing[*]:-none (EMBPS_GPU_FORCE_DEBS set)}; using the .deb files in $DEBS"
    if ! compgen -G "$DEBS/*.deb" >/dev/null; then
      note="missing ${missing[*]} and no .deb files in $DEBS (run tests/gpu/fetch_debs.sh where apt works, carry .gpu-debs)"
    else
      rm -rf "$DEPS_PREFIX"
      # shellcheck disable=SC2016 # expanded by the inner bash
      if timeout 120 bash -c '. "$1"; embps_debs_unpack "$2" "$3"' _ "$ROOT/tests/gpu/debs_env.sh" \
        "$DEBS" "$DEPS_PREFIX"; then
        embps_debs_env "$DEPS_PREFIX"
        find_missing
        note="unpacked $(find "$DEBS" -maxdepth 1 -name '*.deb' | wc -l) .debs into $DEPS_PREFIX"
      else
        note="unpacking $DEBS failed"
      fi
    fi
  fi
  if [ ${#missing[@]} -eq 0 ]; then
    echo "pkg-config $(pkg-config --version): libuv $(pkg-config --modversion libuv), nghttp2 $(pkg-config --modversion libnghttp2), protobuf-c $(pkg-config --modversion libprotobuf-c), cmocka $(pkg-config --modversion cmocka); $(protoc-c --version 2>&1 | head -1)"
    record deps PASS $((SECONDS - t0)) "$note"
  else
    record deps FAIL $((SECONDS - t0)) "${note:-still missing: ${missing[*]}}"
  fi

  # ---- (b) configure and build --------------------------------------------------------------
  local gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  if [ "${RESULT[deps]}" = FAIL ]; then
    record configure SKIP 0 "dependencies missing"
    record build SKIP 0 "dependencies missing"
  else
    t0=$SECONDS
    # A build dir made by another generator cannot be reused.
    if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -q "CMAKE_GENERATOR:INTERNAL=${gen[1]:-Unix Makefiles}" "$BUILD/CMakeCache.txt"; then
      rm -rf "$BUILD"
    fi
    # NCCL (optional for the build): where the toolkit has none, a Python wheel's (nvidia-nccl-cu*,
    # beside PyTorch) will do: its header and its libnccl.so.2, which find_library would not
    # find under that name.
    local nccl=() d
    if ! [ -f /usr/local/cuda/include/nccl.h ] && ! [ -f /usr/include/nccl.h ] &&
      command -v python3 >/dev/null 2>&1; then
      d=$(timeout 30 python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
      if [ -n "$d" ] && [ -f "$d/include/nccl.h" ] && [ -f "$d/lib/libnccl.so.2" ]; then
        nccl=(-DNCCL_INCLUDE_DIR="$d/include" -DNCCL_LIBRARY="$d/lib/libnccl.so.2")
        export LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "NCCL from the Python wheel in $d"
      fi
    fi
    run_step configure 120 cmake -S "$ROOT" -B "$BUILD" "${gen[@]}" -DEMBPS_CUDA=ON \
      -DEMBPS_WERROR="$WERROR" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${nccl[@]}"
    if [ "$RC" -eq 0 ]; then
      record configure PASS $((SECONDS - t0)) "$(grep -o 'CMAKE_CUDA_COMPILER:[A-Z]*=.*' "$BUILD/CMakeCache.txt" | cut -d= -f2), nccl $(grep -o '^NCCL_LIBRARY:[A-Z]*=.*' "$BUILD/CMakeCache.txt" | cut -d= -f2), werror $WERROR"
      t0=$SECONDS
      echo
      echo "=== build (log: build.log; last lines follow)"
      run_step build 300 cmake --build "$BUILD" -j"$(nproc)" >"$WORK/build.log" 2>&1
      tail -n 15 "$WORK/build.log"
      if [ "$RC" -eq 0 ]; then
        record build PASS $((SECONDS - t0)) "$(grep -c "Building" "$WORK/build.log") objects compiled"
      else
        grep -E -B2 -A8 'error|FAILED' "$WORK/build.log" | head -60
        record build FAIL $((SECONDS - t0)) "$(why "$RC")"
      fi
    else
      record configure FAIL $((SECONDS - t0)) "$(why "$RC")"
      record build SKIP 0 "not configured"
    fi
  fi
  local built=0
  [ "${RESULT[build]}" = PASS ] && built=1

  # Is a GPU visible? (the benchmark's probe; 77 = none)
  local gpu=0
  if [ "$built" = 1 ]; then
    echo
    echo "=== probe"
    if timeout 60 "$BUILD/bin/bench_kernels_gpu" --probe; then gpu=1; fi
  fi

  # ---- (c) GPU tests ----------------------------------------------------------------------------
  if [ "$built" = 1 ]; then
    t0=$SECONDS
    (cd "$BUILD" && run_step ctest 240 ctest -L gpu --output-on-failure --timeout 200) 2>&1 |
      tee "$WORK/ctest.txt"
    RC=${PIPESTATUS[0]}
    local total skipped passed
    total=$(grep -Eo 'out of [0-9]+' "$WORK/ctest.txt" | tail -1 | grep -Eo '[0-9]+')
    skipped=$(grep -c '\*\*\*Skipped' "$WORK/ctest.txt")
    passed=$(grep -Ec 'Test +#[0-9]+: .* +Passed' "$WORK/ctest.txt")
    if [ "$RC" -ne 0 ]; then
      record ctest FAIL $((SECONDS - t0)) "$(why "$RC")"
    elif [ -z "$total" ] || [ "$total" -eq 0 ]; then
      record ctest FAIL $((SECONDS - t0)) "no gpu tests found"
    elif [ "$skipped" -eq "$total" ]; then
      record ctest SKIP $((SECONDS - t0)) "$skipped of $total skipped: $(grep -m1 '^SKIP' "$WORK/ctest.txt" || echo 'no GPU visible')"
    else
      record ctest PASS $((SECONDS - t0)) "$passed passed, $skipped skipped of $total"
    fi
  else
    record ctest SKIP 0 "not built"
  fi

  # ---- (d) end to end through the server -----------------------------------------------------------
  if [ "$built" = 1 ]; then
    t0=$SECONDS
    mkdir -p "$WORK/e2e"
    run_step e2e 150 "$ROOT/tests/gpu/e2e_cuda.sh" "$BUILD" "$WORK/e2e" 2>&1 | tee "$WORK/e2e.txt"
    RC=${PIPESTATUS[0]}
    case $RC in
    0) record e2e PASS $((SECONDS - t0)) "" ;;
    77) record e2e SKIP $((SECONDS - t0)) "$(grep -m1 '^SKIP e2e' "$WORK/e2e.txt" | sed 's/^SKIP e2e: //')" ;;
    *) record e2e FAIL $((SECONDS - t0)) "$(grep -m1 '^FAIL' "$WORK/e2e.txt" || why "$RC")" ;;
    esac
  else
    record e2e SKIP 0 "not built"
  fi

  # ---- (e) kernel benchmark --------------------------------------------------------------------------
  if [ "$built" = 1 ]; then
    t0=$SECONDS
    # shellcheck disable=SC2086 # flags split on purpose
    run_step bench 180 "$BUILD/bin/bench_kernels_gpu" $BENCH_FLAGS 2>&1 | tee "$WORK/bench.txt"
    RC=${PIPESTATUS[0]}
    case $RC in
    0) record bench PASS $((SECONDS - t0)) "" ;;
    77) record bench SKIP $((SECONDS - t0)) "$(grep -m1 '^SKIP' "$WORK/bench.txt" | sed 's/^SKIP: //')" ;;
    *) record bench FAIL $((SECONDS - t0)) "$(grep -m1 -E '^(FAIL|FATAL)' "$WORK/bench.txt" || why "$RC")" ;;
    esac
  else
    record bench SKIP 0 "not built"
  fi

  # ---- (f) summary -----------------------------------------------------------------------------------
  local s failed=0
  for s in "${STEPS[@]}"; do
    [ "${RESULT[$s]}" = FAIL ] && failed=1
  done
  {
    echo
    echo "================ embps GPU check summary ($((SECONDS - START))s, gpu visible: $([ $gpu = 1 ] && echo yes || echo no)) ================"
    printf '%-10s %-5s %5s  %s\n' step result secs note
    for s in "${STEPS[@]}"; do
      printf '%-10s %-5s %5s  %s\n' "$s" "${RESULT[$s]}" "${SECS[$s]}" "${NOTE[$s]}"
    done
    if grep -q '^E2E ' "$WORK/e2e.txt" 2>/dev/null; then
      echo
      grep '^E2E ' "$WORK/e2e.txt"
    fi
    if grep -q '^== summary' "$WORK/bench.txt" 2>/dev/null; then
      echo
      sed -n '/^== summary/,$p' "$WORK/bench.txt"
    fi
    echo
    echo "overall: $([ $failed = 0 ] && echo PASS || echo FAIL)"
  } | tee "$WORK/summary.txt"
  copy_out
  return $failed
}

main 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
copy_out
[ -n "${OUT:-}" ] && echo "(log and tables copied to $OUT)"
exit "$rc"
