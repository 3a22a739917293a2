#!/usr/bin/env bash
# gpu-gemv.sh — one GPU call for the W4 decode GEMV (issue 4): builds only
# bench_kernels and test_cuda_ops, runs the CUDA op tests, the GEMV variant
# sweep (old kernel, new kernel's default and forced configurations, each
# validated against the old one) next to the copy ceiling measured in the
# same run, the ptxas resource report and SASS instruction counts of the
# GEMV kernels, and (FL_GEMV_NCU=1, the default) Nsight Compute on the
# default kernel for both Llama-3-8B MLP shapes at batch 1.
#
#   OUT=/tmp/out bash scripts/gpu-gemv.sh     # from the repository root
#
# Files under $OUT (at most 8, the device tool's limit): gpu-gemv.log,
# bench_kernels.json, test_cuda_ops.log, ptxas.log, sass_counts.txt, ncu.txt.
# Dependencies (.deps/debs) are unpacked as scripts/gpu-check.sh does.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out/gpu-gemv}
ARCH=${FL_CUDA_ARCH:-90a}
JOBS=$(nproc 2>/dev/null || echo 4)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
cd "$ROOT" || exit 1
exec > >(tee "$OUT/gpu-gemv.log") 2>&1
step() { echo; echo "== $* ($(date +%T))"; }
status=0

step machine "$ROOT" "$(cat .deps/commit 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv 2>&1 | head -4
nvcc --version | tail -1

step dependencies
# the carried Debian libraries, pkg-config, NCCL (scripts/gpu-env.sh)
. scripts/gpu-env.sh

step build
BUILD=build-gpu
# -Wno-maybe-uninitialized: gcc's -O3 flow analysis flags code outside this
# work (runtime/tok/tok_json.c) under -Werror; the GPU build must not stop there.
if ! cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFL_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
        -DCMAKE_C_FLAGS_RELEASE="-O3 -DNDEBUG -Wno-maybe-uninitialized" \
        ${PKGCONF:+-DPKG_CONFIG_EXECUTABLE=$PKGCONF} >"$OUT/build.txt" 2>&1 ||
    ! make -C "$BUILD" -j"$JOBS" bench_kernels test_cuda_ops >>"$OUT/build.txt" 2>&1; then
    echo "BUILD FAILED"; grep -m 20 -E "error|Error" "$OUT/build.txt"; tail -20 "$OUT/build.txt"; exit 1
fi
echo "build ok"

step ptxas and SASS of the GEMV kernels
nvcc -std=c++17 -O3 -gencode=arch=compute_${ARCH},code=sm_${ARCH} -I. -Xptxas -v \
    -c kernels/cuda/cuda_gemv.cu -o /tmp/gemv.o >"$OUT/ptxas.log" 2>&1
nvcc -std=c++17 -O3 -gencode=arch=compute_${ARCH},code=sm_${ARCH} -I. -Xptxas -v \
    -c kernels/cuda/cuda_matmul.cu -o /tmp/matmul.o 2>&1 | grep -A2 "w4_mma_kernel" >>"$OUT/ptxas.log"
grep -E "registers|spill" "$OUT/ptxas.log" | head -3
# instructions per kernel (static count; the loop body is what matters, see
# docs/cuda.md), plus the full SASS of the default batch-1 variants
cuobjdump --dump-sass /tmp/gemv.o >/tmp/gemv.sass 2>&1
awk '/Function :/ {f=$3} /^ +\/\*[0-9a-f]+\*\// {n[f]++} END {for (k in n) print n[k], k}' /tmp/gemv.sass |
    sort -k2 >"$OUT/sass_counts.txt"
awk '/Function :/ {p = ($3 ~ /ILi1ELi2ELi2ELi2E/)} p' /tmp/gemv.sass >>"$OUT/sass_counts.txt"
wc -l "$OUT/sass_counts.txt"

step test_cuda_ops
timeout 200 "$BUILD/tests/test_cuda_ops" 2>&1 | tee "$OUT/test_cuda_ops.log" | grep -v "^\[ RUN\|^\[       OK"
r=${PIPESTATUS[0]}; echo "test_cuda_ops exit $r"; [ "$r" = 0 ] || status=1

step bench_kernels --sweep
timeout 150 "$BUILD/bench_kernels" --sweep --json "$OUT/bench_kernels.json" 2>&1
r=$?; echo "bench_kernels exit $r"; [ "$r" = 0 ] || status=1

step bench_kernels --sweep-only with --tune pdl=0 '(default configurations only)'
timeout 100 "$BUILD/bench_kernels" --tune pdl=0 --sweep-only 2>&1 | grep -E "^(auto|old)|copy ceiling" | awk '!seen[$1]++'

if [ "${FL_GEMV_NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
    step ncu
    for shape in "14336 4096 1" "4096 14336 1"; do
        timeout 60 ncu --clock-control none -k regex:w4_gemv_kernel --launch-skip 2 --launch-count 1 \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
            --section SchedulerStats --section WarpStateStats --section InstructionStats \
            "$BUILD/bench_kernels" --one $shape 2>&1 | grep -v "^==PROF==" >>"$OUT/ncu.txt"
    done
    M=dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum
    for r in long_scoreboard short_scoreboard wait math_pipe_throttle not_selected selected barrier lg_throttle \
        no_instruction dispatch_stall mio_throttle branch_resolving drain imc_miss; do
        M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
    done
    for shape in "14336 4096 1" "4096 14336 1"; do
        timeout 60 ncu --clock-control none -k regex:w4_gemv_kernel --launch-skip 2 --launch-count 1 --metrics "$M" \
            "$BUILD/bench_kernels" --one $shape 2>&1 | grep -v "^==PROF==" >>"$OUT/ncu.txt"
    done
    grep -E "w4_gemv_kernel|Duration|DRAM Throughput|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|dram__bytes|stalled|inst_exec" "$OUT/ncu.txt"
fi

step done
echo "gpu-gemv: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
