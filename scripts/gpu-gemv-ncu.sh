#!/usr/bin/env bash
# gpu-gemv-ncu.sh — Nsight Compute on the W4 GEMV kernels, one launch each,
# under each W4 kernel setting of FL_NCU_KERNELS (ring, bulk, bulk,V,W: the
# bench's --tune w4_gemv, w4_gemv_variant, w4_gemv_warps) and
# each shape of FL_NCU_SHAPES ("OUT IN N"): speed of light, warp state and
# the stall reasons per issued instruction. Run after scripts/gpu-all.sh
# (uses its build-gpu/). Writes $OUT/ncu-<setting>-<shape>.txt and prints
# the lines that matter.
#   FL_NCU_KERNELS="ring bulk,2,4" FL_NCU_SHAPES="14336 4096 1" bash scripts/gpu-gemv-ncu.sh
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
cd "$ROOT" || exit 1
. scripts/gpu-env.sh
M=dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum
for r in long_scoreboard short_scoreboard wait math_pipe_throttle not_selected selected barrier lg_throttle \
    no_instruction dispatch_stall mio_throttle branch_resolving drain imc_miss membar sleeping tex_throttle; do
    M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
done
for k in ${FL_NCU_KERNELS:-ring bulk}; do
    IFS=, read -r kern_ var_ warps_ <<<"$k"
    tune=(--tune "w4_gemv=$kern_")
    [ -n "${var_:-}" ] && tune+=(--tune "w4_gemv_variant=$var_" --tune "w4_gemv_warps=${warps_:-0}")
    IFS=';' read -ra shapes <<<"${FL_NCU_SHAPES:-14336 4096 1;4096 14336 1}"
    for shape in "${shapes[@]}"; do
        f="$OUT/ncu-${k//,/_}-${shape// /x}.txt"
        # the third launch: the first two pay the module load and first-touch costs
        timeout 90 ncu --clock-control none -k "regex:w4_(gemv|bulk)_kernel" --launch-skip 2 \
            --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
            --section SchedulerStats --section WarpStateStats --metrics "$M" \
            build-gpu/bench_kernels "${tune[@]}" --one $shape 2>&1 | grep -v "^==PROF==" >"$f"
        echo "== ${tune[*]} $shape"
        grep -E "_kernel|Duration|DRAM Throughput|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Eligible Warps|Issued Warp|inst_executed|stalled" "$f" |
            awk '$NF+0 > 0.05 || !/stalled/' | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//'
    done
done
