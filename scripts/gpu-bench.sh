#!/usr/bin/env bash
# gpu-bench.sh — flotilla bench on the GPU machine, after scripts/gpu-check.sh
# built build-gpu/: synthetic models of real shapes, decode tok/s and GB/s
# against the copy ceiling measured in each run. Results (JSON per run and a
# summary) go to $OUT/bench (default out/bench).
#
#   bash scripts/gpu-bench.sh [PRESET:QUANT:BATCH ...]
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out}/bench
BUILD=${FL_GPU_BUILD:-$ROOT/build-gpu}
mkdir -p "$OUT"
cd "$ROOT" || exit 1
commit=$(cat .deps/commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
if ! make -C "$BUILD" -j"$(nproc)" flotilla >"$OUT/flotilla-build.log" 2>&1; then
    # A newer compiler there may warn where ours does not: report, then build anyway.
    echo "flotilla build failed with -Werror; warnings:"; grep -m 10 -E "error" "$OUT/flotilla-build.log"
    cmake -S . -B "$BUILD" -DFL_WERROR=OFF >/dev/null 2>&1
    make -C "$BUILD" -j"$(nproc)" flotilla >"$OUT/flotilla-build.log" 2>&1 ||
        { echo "flotilla build failed:"; grep -m 10 -E "error" "$OUT/flotilla-build.log"; exit 1; }
fi
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(llama-3-8b:w4:1 llama-3-8b:none:1 llama-3-8b:w4:16 qwen2-7b:w4:1)
export OMP_NUM_THREADS=$(nproc)
status=0
for r in "${runs[@]}"; do
    IFS=: read -r preset quant batch <<<"$r"
    name="$preset-$quant-b$batch"
    echo "== $name ($(date +%T))"
    if timeout 300 "$BUILD/flotilla" bench --preset "$preset" --quantize "$quant" --batch "$batch" \
        --prompt-len 16 --gen-len 64 --backend cuda --output "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"; then
        python3 - "$OUT/$name.json" "$commit" <<'PY'
import json, sys, datetime
p = sys.argv[1]; d = json.load(open(p))
d["commit"] = sys.argv[2]; d["date"] = datetime.date.today().isoformat(); d["machine"] = "nvidia-h200"
json.dump(d, open(p, "w"))
PY
    else
        echo "$name failed"; status=1
    fi
done
exit $status
