#!/bin/sh
# The CPU kernels that hide their random-row misses with __builtin_prefetch must still hold a
# prefetch instruction once compiled: GCC 12 deleted every prefetch of
# kernels/segment_sum_stats.c while it sat in a function of its own (found free of side
# effects), and nothing failed; only the push's speed fell.
#   test_prefetch_emitted.sh LIBEMBPS_KERNELS.a
lib=$1
case $(uname -m) in x86_64 | amd64) ;; *) echo "SKIP: the check reads x86-64 disassembly, this is $(uname -m)"; exit 77 ;; esac
command -v objdump >/dev/null || { echo "SKIP: objdump (binutils) is not installed"; exit 77; }
[ -f "$lib" ] || { echo "FAIL: no archive at $lib"; exit 1; }
# Prints "MEMBER COUNT" for each object of the archive: its prefetch instructions.
counts=$(objdump -d "$lib" | awk '
  /^[^ ].*:[ \t]+file format/ { sub(/:.*/, ""); m = $0; n[m] += 0; next }
  /\tprefetch/ { n[m]++ }
  END { for (k in n) print k, n[k] }')
rc=0
for obj in gather.c.o segment_sum_stats.c.o opt_sgd.c.o opt_adagrad.c.o opt_rowwise_adagrad.c.o \
  opt_adam.c.o; do
  c=$(printf '%s\n' "$counts" | awk -v o="$obj" '$1 == o { print $2 }')
  if [ -z "$c" ]; then
    echo "FAIL: $obj is not in $lib"; rc=1
  elif [ "$c" -eq 0 ]; then
    echo "FAIL: $obj holds no prefetch instruction"; rc=1
  else
    echo "ok: $obj holds $c prefetch instruction(s)"
  fi
done
exit $rc
