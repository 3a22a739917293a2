#!/usr/bin/env bash
# build.sh [BUILD_DIR] [cmake args...] — configures and builds flotilla
# (CPU backend always; CUDA backend when nvcc is found).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build "$dir" -j "$(nproc)" 2>&1 | grep -vE '^\[|^-- |Building|Linking|Built target|Scanning' || true
test -x "$dir/flotilla"
