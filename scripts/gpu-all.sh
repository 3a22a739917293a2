#!/usr/bin/env bash
# gpu-all.sh — everything the GPU machine checks, in one call, in order of
# importance (device time is scarce): build once (build-gpu, with NCCL), the
# CUDA op / golden / graph tests, the W4 GEMV microbenchmark, then on a
# machine with 2+ GPUs the multi-GPU correctness check
# (scripts/gpu-multi-check.sh) and the scaling runs (scripts/gpu-scaling.sh).
# Results: $OUT/all.tgz and $OUT/summary.txt.
#   bash scripts/gpu-all.sh
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTROOT=${OUT:-$ROOT/out}
export OUT=$OUTROOT
R=$OUTROOT/all
mkdir -p "$R"
cd "$ROOT" || exit 1
exec > >(tee "$OUTROOT/summary.txt") 2>&1
step() { echo; echo "== $* ($(date +%T))"; }
. scripts/gpu-env.sh
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
step "build ($NGPU GPUs, commit $(cat .deps/commit 2>/dev/null))"
gpu_configure "$R/cmake.log" || exit 1
make -C build-gpu -j"$(nproc)" flotilla test_cuda_ops test_cuda_golden test_cuda_graph bench_kernels \
    mpi_test_comm >"$R/build.log" 2>&1 || { grep -m 10 -E "error" "$R/build.log"; exit 1; }
status=0
for t in test_cuda_ops test_cuda_golden test_cuda_graph; do
    step "$t"
    timeout 240 build-gpu/tests/$t >"$R/$t.log" 2>&1
    rc=$?; grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED|ERROR|error" "$R/$t.log" | head -12
    echo "$t exit $rc"; [ $rc = 0 ] || status=1
done
step bench_kernels
timeout 120 build-gpu/bench_kernels --json "$R/bench_kernels.json" >"$R/bench_kernels.log" 2>&1
grep -iE "gemv|ceiling" "$R/bench_kernels.log" | head -12
if [ "$NGPU" -ge 2 ]; then
    step multi-gpu correctness
    FL_NP=$NGPU FL_MULTI_LIMIT=60 FL_MULTI_STOP_ON_HANG=1 bash scripts/gpu-multi-check.sh 2>&1 |
        grep -v "NCCL INFO" | tail -20
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    # Scaling on every power of two up to NGPU (the 1-GPU runs are made once).
    for np_ in ${FL_SCALING_NPS:-$(n=2; while [ $n -le "$NGPU" ]; do echo $n; n=$((n * 2)); done)}; do
        step "scaling on $np_ GPUs"
        FL_NP=$np_ bash scripts/gpu-scaling.sh 2>&1 | tail -30
    done
fi
step done
echo "gpu-all: $([ $status = 0 ] && echo PASS || echo FAIL)"
tar czf "$OUTROOT/all.tgz" -C "$OUTROOT" all multi scaling 2>/dev/null
rm -rf "$R" "$OUTROOT/multi" "$OUTROOT/scaling"
exit $status
