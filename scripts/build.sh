#!/usr/bin/env bash
# build.sh [BUILD_DIR] [cmake args...] — configures and builds flotilla
# (CPU backend always; CUDA backend when nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
# The build's own status decides (grep only thins its output): a target that
# fails to build must fail here, not later as a test "not found".
set +e
cmake --build "$dir" -j "$(nproc)" 2>&1 | grep -vE '^\[|^-- |Building|Linking|Built target|Scanning'
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" != 0 ]; then
  echo "build.sh: building $dir failed (cmake --build exit $rc)" >&2
  exit 1
fi
test -x "$dir/flotilla"
