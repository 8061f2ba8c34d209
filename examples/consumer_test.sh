#!/usr/bin/env bash
# Builds and runs examples/ as another project would use remat: (1) installed with cmake --install
# and found with find_package(remat); (2) added from the source tree with add_subdirectory.
# Usage: consumer_test.sh SOURCE_DIR BUILD_DIR CMAKE
set -euo pipefail
src=$1 build=$2 cmake=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
jobs=$(nproc)

"$cmake" --install "$build" --prefix "$tmp/prefix" >/dev/null
"$cmake" -S "$src/examples" -B "$tmp/installed" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
"$cmake" --build "$tmp/installed" -j"$jobs" >/dev/null
"$tmp/installed/example"

"$cmake" -S "$src/examples" -B "$tmp/subdir" -DREMAT_SOURCE_DIR="$src" >/dev/null
"$cmake" --build "$tmp/subdir" -j"$jobs" >/dev/null
"$tmp/subdir/example"
echo "consumer: find_package(remat) and add_subdirectory both build and run the example"
