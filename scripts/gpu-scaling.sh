#!/usr/bin/env bash
# gpu-scaling.sh — the scaling runs: `flotilla bench` presets on 1 GPU
# and under mpirun on NP GPUs (tensor parallel; expert parallel for MoE),
# each run measuring its own ceilings (copy bandwidth per GPU, NCCL
# all-reduce latency and bus bandwidth). JSON per run under $OUT/scaling,
# then a table (scaling efficiency = tok/s on NP GPUs / (NP x tok/s on 1)),
# also as scaling.csv (scripts/scaling-table.py) and scaling.png
# (scripts/plot-scaling.sh, where gnuplot is installed).
#   FL_NP=2 bash scripts/gpu-scaling.sh
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out}/scaling
mkdir -p "$OUT"
cd "$ROOT" || exit 1
NP=${FL_NP:-2}
. scripts/gpu-env.sh
[ -x build-gpu/flotilla ] || { gpu_configure "$OUT/cmake.log" && make -C build-gpu -j"$(nproc)" flotilla >"$OUT/build.log" 2>&1; } ||
    { echo "build failed"; exit 1; }
fl=build-gpu/flotilla
# preset:quant:batch:ep[:opt] (ep "np" = the number of GPUs). opt "own" puts
# NCCL on its own stream with host syncs around each collective
# (FL_NCCL_OWN_STREAM=1), "p2p" turns on the one-shot peer-memory all-reduce
# for small messages (FL_P2P_AR=1), to compare with the default (NCCL on the
# compute stream).
runs=${FL_SCALING_RUNS:-"llama-3-8b:w4:1:1 llama-3-8b:none:1:1 llama-3-8b:w4:16:1 llama-3-8b:w4:64:1 mixtral-8x7b:w4:1:np mixtral-8x7b:w4:64:np qwen3-30b-a3b:w4:1:np"}
for r in $runs; do
    if [ -n "${FL_DEADLINE:-}" ] && [ "$(date +%s)" -ge "$FL_DEADLINE" ]; then
        echo "(deadline reached: skipping the remaining runs from $r)"; break
    fi
    IFS=: read -r preset q b ep opt <<<"$r"
    [ "$ep" = np ] && ep=$NP
    tag=$preset-$q-b$b
    unset FL_NCCL_OWN_STREAM FL_P2P_AR
    [ "$opt" = own ] && export FL_NCCL_OWN_STREAM=1
    [ "$opt" = p2p ] && export FL_P2P_AR=1
    [ -f "$OUT/np1-$tag.json" ] || timeout 120 $fl bench --backend cuda --preset "$preset" --quantize "$q" \
        --batch "$b" --output "$OUT/np1-$tag.json" 2>&1 | tail -1
    name=np$NP-$tag-ep$ep${opt:+-$opt}
    timeout 150 mpirun --allow-run-as-root -np "$NP" -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE \
        ${FL_NCCL_OWN_STREAM:+-x FL_NCCL_OWN_STREAM} ${FL_P2P_AR:+-x FL_P2P_AR} \
        $fl bench --backend cuda --preset "$preset" --quantize "$q" --batch "$b" --tp "$NP" --ep "$ep" \
        --output "$OUT/$name.json" >"$OUT/$name.log" 2>&1
    rc=$?; tail -3 "$OUT/$name.log"; [ $rc = 0 ] || echo "$name: exit $rc"
done
unset FL_NCCL_OWN_STREAM FL_P2P_AR
# the table (Markdown here, CSV beside the JSON) and its plot
python3 scripts/scaling-table.py "$OUT" "$NP" --csv "$OUT/scaling.csv" &&
    { ! command -v gnuplot >/dev/null || scripts/plot-scaling.sh "$OUT/scaling.csv" "$OUT/scaling.png"; }
