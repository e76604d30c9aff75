#!/usr/bin/env bash
# Downloads the .deb files that tests/gpu/check.sh unpacks on a GPU machine that lacks the
# build's Debian dev packages and cannot download them (no network there). Run it HERE, on a
# machine with Debian's archive (apt), from anywhere in the repo:
#
#   tests/gpu/fetch_debs.sh [DIR]      DIR: default $EMBPS_GPU_DEBS, else .gpu-debs/ in the repo
#
# The set: the dev packages the build needs (libuv, nghttp2, protobuf-c with protoc-c, cmocka,
# ISA-L, libmicrohttpd, OpenSSL, xxHash (the batch digest's header), jansson (the CLI's JSON
# input), pkg-config) and the closure of their Depends/Pre-Depends computed with apt-cache depends,
# stopping at BASE, the packages any machine with a CUDA toolkit has (the C/C++ runtime).
# It then checks the set standalone: everything is unpacked into an empty prefix and
# protoc-c --version and pkg-config for every module must work from there alone.
# .gpu-debs/ is git-ignored: name it in the device tool's `carry` to take it along.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DIR=${1:-${EMBPS_GPU_DEBS:-$ROOT/.gpu-debs}}
ROOTS=(libuv1-dev libnghttp2-dev libprotobuf-c-dev protobuf-c-compiler libcmocka-dev libisal-dev libmicrohttpd-dev libssl-dev libxxhash-dev libjansson-dev pkgconf)
# The C library's own headers (libc6-dev and what it pulls in) are the toolchain's: unpacked
# under the prefix, whose include directory comes first, Debian's glibc 2.36 stdio.h met another
# glibc's bits/ on the H200 machine and the build stopped (L_tmpnam undeclared).
BASE=" libc6 libgcc-s1 libstdc++6 zlib1g libcrypt1 gcc-12-base debconf libc6-dev libc-dev-bin linux-libc-dev libcrypt-dev "
MODULES=(libuv libnghttp2 libprotobuf-c cmocka libisal libmicrohttpd openssl libxxhash jansson)

# shellcheck source=tests/gpu/debs_env.sh
. "$ROOT/tests/gpu/debs_env.sh"

# ---- dependency closure ------------------------------------------------------------------------
declare -A seen=()
queue=("${ROOTS[@]}")
closure=()
while [ ${#queue[@]} -gt 0 ]; do
  pkg=${queue[0]}
  queue=("${queue[@]:1}")
  [ -n "${seen[$pkg]:-}" ] && continue
  seen[$pkg]=1
  case "$BASE" in *" $pkg "*) continue ;; esac
  closure+=("$pkg")
  # Depends lines; for a virtual package ("<pkg-config>") the next, indented line names the
  # provider; for alternatives ("|Depends: a" then "Depends: b") the first is taken.
  mapfile -t deps < <(apt-cache depends --no-recommends --no-suggests --no-conflicts \
    --no-breaks --no-replaces --no-enhances "$pkg" | awk '
      /^ *\|?(Pre)?Depends:/ {
        name = $2
        if (alt) { alt = ($1 ~ /^\|/); next }   # skip the later alternatives
        alt = ($1 ~ /^\|/)
        if (name ~ /^</) { want_provider = 1; next }
        print name; next
      }
      /^    [^ ]/ && want_provider { print $1; want_provider = 0; next }
      { want_provider = 0 }')
  for d in "${deps[@]}"; do
    d=${d%%:*} # drop an architecture qualifier (foo:any)
    [ -n "$d" ] && [ -z "${seen[$d]:-}" ] && queue+=("$d")
  done
done
echo "packages (${#closure[@]}): ${closure[*]}"
echo "assumed present on the GPU machine (not fetched):${BASE% }"

# ---- download ----------------------------------------------------------------------------------
mkdir -p "$DIR"
rm -f "$DIR"/*.deb
(cd "$DIR" && apt-get download "${closure[@]}")
echo
ls -l "$DIR"
echo "total: $(du -cb "$DIR"/*.deb | tail -1 | cut -f1) bytes in $(find "$DIR" -maxdepth 1 -name "*.deb" | wc -l) files"

# ---- check: unpacked alone into an empty prefix, with the system's pkg-config path hidden -------
tmp=$(mktemp -d /tmp/embps-debs-check.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
embps_debs_unpack "$DIR" "$tmp/prefix"
(
  embps_debs_env "$tmp/prefix"
  # Only the prefix: no system .pc files, so a module found proves the prefix holds it.
  export PKG_CONFIG_LIBDIR="$tmp/prefix/usr/lib/x86_64-linux-gnu/pkgconfig:$tmp/prefix/usr/share/pkgconfig"
  unset PKG_CONFIG_PATH
  set -x
  "$tmp/prefix/usr/bin/protoc-c" --version
  "$tmp/prefix/usr/bin/pkg-config" --version
  "$tmp/prefix/usr/bin/pkg-config" --cflags --libs "${MODULES[@]}"
  set +x
  for m in "${MODULES[@]}"; do
    for what in --cflags-only-I --libs-only-L; do
      flags=$("$tmp/prefix/usr/bin/pkg-config" "$what" "$m")
      case "$flags" in *"-${what: -1}$tmp/prefix/usr/"*) ;; *)
        echo "FAIL: pkg-config $what $m gives '$flags', not a directory in the prefix" >&2
        exit 1 ;;
      esac
    done
  done
  echo "protoc-c loads:"
  ldd "$tmp/prefix/usr/bin/protoc-c" | grep -E 'proto' | sed 's/^/  /'
  if ldd "$tmp/prefix/usr/bin/protoc-c" | grep -E 'libproto' | grep -vq "$tmp/prefix"; then
    echo "FAIL: protoc-c loads a protobuf library from outside the prefix" >&2
    exit 1
  fi
  # Every shared object the set brings must resolve with the prefix and the base system alone.
  bad=0
  while IFS= read -r -d '' f; do
    if ldd "$f" 2>/dev/null | grep -q 'not found'; then
      echo "FAIL: unresolved libraries in $f:" >&2
      ldd "$f" | grep 'not found' >&2
      bad=1
    fi
  done < <(find "$tmp/prefix/usr/bin" "$tmp/prefix/usr/lib" -type f \( -name '*.so*' -o -perm -u+x \) -print0)
  [ "$bad" -eq 0 ] || exit 1
  # The newest glibc symbol version anything in the set needs: the GPU machine needs at least it.
  glibc=$(find "$tmp/prefix/usr/bin" "$tmp/prefix/usr/lib" -type f \( -name '*.so*' -o -perm -u+x \) \
    -exec objdump -T {} + 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -t. -k1,1 -k2,2n -u | tail -1 ||
    true) # objdump fails on the set's scripts (find then fails): only its output matters
  cxx=$(find "$tmp/prefix/usr/bin" "$tmp/prefix/usr/lib" -type f \( -name '*.so*' -o -perm -u+x \) \
    -exec objdump -T {} + 2>/dev/null | grep -o 'GLIBCXX_[0-9.]*' | sort -t. -k1,1 -k2,2n -k3,3n -u | tail -1 ||
    true)
  echo "newest symbol versions needed: ${glibc:-unknown}, ${cxx:-unknown} (this machine: $(ldd --version | head -1))"
)
echo "OK: $DIR works standalone; carry it with the device tool (carry: [\".gpu-debs\"])"
