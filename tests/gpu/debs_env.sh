# shellcheck shell=bash
# Sourced by tests/gpu/check.sh and tests/gpu/fetch_debs.sh (bash): unpacks a directory of
# .deb files into a private prefix and points the build at it.
#
#   embps_debs_unpack DEBS_DIR PREFIX   extracts every DEBS_DIR/*.deb into PREFIX (dpkg -x, or
#                                       ar + tar where dpkg is missing), makes the pkg-config
#                                       files' /usr paths point into PREFIX
#   embps_debs_env PREFIX               exports PATH, LD_LIBRARY_PATH, PKG_CONFIG_PATH and
#                                       CMAKE_PREFIX_PATH so that PREFIX/usr comes first
#
# Nothing is installed system-wide; the prefix can be removed at any time.

embps_debs_unpack() {
  local debs=$1 prefix=$2 deb n=0
  mkdir -p "$prefix" || return 1
  for deb in "$debs"/*.deb; do
    [ -e "$deb" ] || continue
    if command -v dpkg >/dev/null 2>&1; then
      dpkg -x "$deb" "$prefix" || return 1
    elif command -v ar >/dev/null 2>&1; then
      local member
      member=$(ar t "$deb" | grep '^data\.tar') || return 1
      ar p "$deb" "$member" | tar -x -a -f - -C "$prefix" 2>/dev/null ||
        ar p "$deb" "$member" | tar -x -J -f - -C "$prefix" ||
        return 1
    else
      echo "embps_debs_unpack: neither dpkg nor ar is available to unpack $deb" >&2
      return 1
    fi
    n=$((n + 1))
  done
  if [ "$n" -eq 0 ]; then
    echo "embps_debs_unpack: no .deb files in $debs" >&2
    return 1
  fi
  # Debian's .pc files name absolute /usr paths, in variables (libdir=/usr/lib/x86_64-linux-gnu)
  # or in the flags themselves (cmocka: Libs: -L/usr/lib/x86_64-linux-gnu -lcmocka, which
  # pkg-config would drop as a system directory): point both into the prefix.
  local pc
  while IFS= read -r -d '' pc; do
    sed -i -E -e "s#^([A-Za-z_]+)=/usr([/ ]|\$)#\\1=$prefix/usr\\2#" \
      -e "s#-([IL])/usr/#-\\1$prefix/usr/#g" "$pc"
  done < <(find "$prefix" -name '*.pc' -print0)
  echo "unpacked $n .deb files from $debs into $prefix"
}

embps_debs_env() {
  local p=$1/usr multiarch=x86_64-linux-gnu
  export PATH="$p/bin:$PATH"
  export LD_LIBRARY_PATH="$p/lib/$multiarch:$p/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PKG_CONFIG_PATH="$p/lib/$multiarch/pkgconfig:$p/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export CMAKE_PREFIX_PATH="$p${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
}
