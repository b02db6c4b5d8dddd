#!/usr/bin/env bash
# Run where apt-get works (not on the GPU machine, which has no package registry):
# fetches Debian's liburing-dev and liburing2 and unpacks the headers and the static
# liburing.a into build/deps/liburing/{include,lib}. Carry that directory to the GPU
# machine; test/gpu/run_on_gpu_machine.sh then builds NVMe offload against it
# (HVDZ_LIBURING_ROOT), and nothing of liburing is needed there at run time.
# Prints the directory.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEST=$ROOT/build/deps/liburing
tmp=$(mktemp -d)
chmod 755 "$tmp"  # apt-get download runs as _apt where it can
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get download -q liburing-dev liburing2 >&2)
for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
rm -rf "$DEST"
mkdir -p "$DEST/include" "$DEST/lib"
cp -r "$tmp/root/usr/include/." "$DEST/include/"
cp "$tmp"/root/usr/lib/*/liburing.a "$DEST/lib/"
echo "$DEST"
