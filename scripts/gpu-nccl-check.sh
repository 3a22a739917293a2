#!/usr/bin/env bash
# gpu-nccl-check.sh — the NCCL collectives (parallel/comm_nccl.c) on the GPU
# machine at world size 1: run after scripts/gpu-check.sh (which unpacks the
# carried libraries and configures build-gpu/). The machine's CUDA toolkit has
# no NCCL; PyTorch's wheel (nvidia-nccl-cu13) does, so we point CMake at it.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out}
cd "$ROOT" || exit 1
. scripts/gpu-env.sh
if [ -z "$NCCL_PY" ] || [ ! -e "$NCCL_PY/lib/libnccl.so.2" ]; then
    echo "no NCCL found (python package nvidia.nccl)"; exit 1
fi
echo "NCCL from $NCCL_PY"
gpu_configure "$OUT/nccl-cmake.log" || exit 1
make -C build-gpu -j"$(nproc)" mpi_test_comm >"$OUT/nccl-build.log" 2>&1 ||
    { grep -m 10 error "$OUT/nccl-build.log"; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
FL_TEST_COMM=nccl timeout 120 mpirun --allow-run-as-root -np 1 build-gpu/tests/mpi_test_comm 2>&1 |
    tee "$OUT/nccl-test.log" | grep -v "^\[ RUN\|^\[       OK"
