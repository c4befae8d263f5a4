#!/usr/bin/env bash
# Copies the header-only build dependencies installed on this machine (Debian's
# nlohmann-json3-dev, catch2 v2 and libgloo-dev, which scripts/setup.sh installs) into
# third_party/include, for a machine that has torch, CMake and a compiler but not those packages
# and no network (the GPU machine of benchmarks/gpu_check.sh). CMake uses third_party/include
# only where it cannot find the system's copies, so a machine with the packages builds as before.
#
# Python's development headers too, into third_party/python<major>.<minor>/include, for an
# interpreter that lacks its own (CMakeLists.txt uses them only then, and only for the same
# minor version: a module built on other headers would not load). Which versions:
# VENDOR_PYTHON_VERSIONS (default 3.12, the GPU image's), each copied from an interpreter of that
# version on this machine (python3.12 on PATH or pyenv's versions/3.12.*). PyPI has no package of
# CPython's headers and Debian 12 ships only 3.11's, so a version with no interpreter here is
# reported and left out.
# third_party/ is ignored by git: carry it to the other machine with the working tree.
#
#   bash scripts/vendor_headers.sh        # then: du -sh third_party (about 4 MB)
set -euo pipefail
cd "$(dirname "$0")/.."

SRC=${VENDOR_HEADERS_FROM:-/usr/include}
DEST=third_party/include
PYTHON_VERSIONS=${VENDOR_PYTHON_VERSIONS:-3.12}

# Catch2 v3 (Debian 13) is a compiled library, not a header: only v2's single header is vendored.
needed=("$SRC/nlohmann/json.hpp" "$SRC/catch2/catch.hpp" "$SRC/gloo/rendezvous/store.h")
for f in "${needed[@]}"; do
  if [ ! -f "$f" ]; then
    echo "vendor_headers: $f is missing. Install the packages first (bash scripts/setup.sh, or" \
         "apt-get install nlohmann-json3-dev catch2 libgloo-dev); Catch2 must be v2 (catch2/catch.hpp)." >&2
    exit 1
  fi
done

rm -rf "$DEST" third_party/python[0-9]*
mkdir -p "$DEST" third_party/licenses
cp -a "$SRC/nlohmann" "$SRC/catch2" "$SRC/gloo" "$DEST/"
for pkg in nlohmann-json3-dev catch2 libgloo-dev; do
  if [ -f "/usr/share/doc/$pkg/copyright" ]; then
    cp "/usr/share/doc/$pkg/copyright" "third_party/licenses/$pkg.copyright"
  fi
done
{
  echo "# Copied by scripts/vendor_headers.sh from $SRC on $(date -u +%Y-%m-%dT%H:%MZ)"
  dpkg-query -W -f='${Package} ${Version}\n' nlohmann-json3-dev catch2 libgloo-dev 2>/dev/null || true
} > third_party/VERSIONS

# An interpreter of Python $1 that runs here, or nothing (pyenv's shims exist for versions that
# are not selected, and fail when run: each candidate is asked for its version).
python_of_version() {
  local v=$1 candidate
  for candidate in "python$v" $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/"python$v" 2>/dev/null | sort -V -r); do
    if [ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$v" ]; then
      command -v "$candidate"; return 0
    fi
  done
}

for v in $PYTHON_VERSIONS; do
  py=$(python_of_version "$v")
  if [ -z "$py" ]; then
    echo "vendor_headers: no Python $v here (neither python$v nor pyenv's $v.*): third_party/python$v not made." \
         "PyPI has no package of CPython's headers; install Python $v (e.g. pyenv install $v) and rerun." >&2
    continue
  fi
  inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  if [ ! -f "$inc/Python.h" ]; then
    echo "vendor_headers: $py has no Python.h in $inc: third_party/python$v not made" >&2
    continue
  fi
  mkdir -p "third_party/python$v"
  cp -a "$inc" "third_party/python$v/include"
  # Debian's pyconfig.h only includes the architecture's (<x86_64-linux-gnu/python3.X/pyconfig.h>),
  # which lives outside $inc: put that one in its place.
  arch_config=$(sed -n 's|^# *include <\(.*/python'"$v"'/pyconfig.h\)>.*|/usr/include/\1|p' "$inc/pyconfig.h" | head -1)
  if [ -n "$arch_config" ] && [ -f "$arch_config" ]; then
    cp "$arch_config" "third_party/python$v/include/pyconfig.h"
  fi
  cp "$("$py" -c 'import os, sys; print(os.path.join(sys.base_prefix, "lib", "python%d.%d" % sys.version_info[:2], "LICENSE.txt"))')" \
    "third_party/licenses/python$v.LICENSE.txt" 2>/dev/null || true
  echo "python$v $("$py" -c 'import platform; print(platform.python_version())') headers from $inc" >> third_party/VERSIONS
  echo "vendor_headers: Python $v's headers from $inc"
done

bytes=$(du -sb third_party | cut -f1)
echo "vendor_headers: $(find third_party -type f | wc -l) files, $((bytes / 1024)) KiB in third_party/"
# The GPU machine receives ignored paths within 64 MiB in all; stay far below it.
if [ "$bytes" -gt $((16 * 1024 * 1024)) ]; then
  echo "vendor_headers: third_party/ is over 16 MiB; something other than headers was copied" >&2
  exit 1
fi
