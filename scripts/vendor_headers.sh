#!/usr/bin/env bash
# Copies the header-only build dependencies installed on this machine (Debian's
# nlohmann-json3-dev, catch2 v2 and libgloo-dev, which scripts/setup.sh installs) into
# third_party/include, for a machine that has torch, CMake and a compiler but not those packages
# and no network (the GPU machine of benchmarks/gpu_check.sh). CMake uses third_party/include
# only where it cannot find the system's copies, so a machine with the packages builds as before.
# third_party/ is ignored by git: carry it to the other machine with the working tree.
#
#   bash scripts/vendor_headers.sh        # then: du -sh third_party (about 2 MB)
set -euo pipefail
cd "$(dirname "$0")/.."

SRC=${VENDOR_HEADERS_FROM:-/usr/include}
DEST=third_party/include

# Catch2 v3 (Debian 13) is a compiled library, not a header: only v2's single header is vendored.
needed=("$SRC/nlohmann/json.hpp" "$SRC/catch2/catch.hpp" "$SRC/gloo/rendezvous/store.h")
for f in "${needed[@]}"; do
  if [ ! -f "$f" ]; then
    echo "vendor_headers: $f is missing. Install the packages first (bash scripts/setup.sh, or" \
         "apt-get install nlohmann-json3-dev catch2 libgloo-dev); Catch2 must be v2 (catch2/catch.hpp)." >&2
    exit 1
  fi
done

rm -rf "$DEST"
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

bytes=$(du -sb third_party | cut -f1)
echo "vendor_headers: $(find third_party -type f | wc -l) files, $((bytes / 1024)) KiB in third_party/"
# The GPU machine receives ignored paths within 64 MiB in all; stay far below it.
if [ "$bytes" -gt $((16 * 1024 * 1024)) ]; then
  echo "vendor_headers: third_party/ is over 16 MiB; something other than headers was copied" >&2
  exit 1
fi
