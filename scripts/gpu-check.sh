#!/usr/bin/env bash
# gpu-check.sh — the one script run on a GPU machine (H200, sm_90a): builds
# the CUDA backend, runs every GPU-labelled test (`FL_REQUIRE_GPU=1 ctest -L
# gpu`: the CUDA test programs, test_backend_ops, test_decode_steps on CUDA;
# a GPU that does not start fails them instead of letting them skip), and
# runs the kernel microbenchmark (W4 GEMV against the device-to-device copy
# ceiling).
#
#   bash scripts/gpu-check.sh        # from the repository root
#
# Writes logs and bench JSON under $OUT (default ./out/gpu-check).
#
# The GPU machine has nvcc, CMake and gcc but not this project's Debian
# libraries (cmocka, cJSON, PCRE2, utf8proc, libyaml, libmicrohttpd, pkg-config): they
# travel as .deb files in .deps/debs/ (git-ignored; fetch them on a Debian
# machine with `apt-get download <names>`) and are unpacked into
# .deps/prefix with dpkg -x. Their pkg-config files say prefix=/usr, so
# they are rewritten to point into the prefix. The GPU machine may also lack
# MPI, which the full CMake build requires (for the launcher); if CMake
# cannot configure (or the build fails, e.g. a newer host gcc adding
# -Werror warnings), the script builds the library, the two CUDA tests and
# the benchmark directly with gcc/nvcc, without -Werror (none needs MPI).
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out/gpu-check}
ARCH=${FL_CUDA_ARCH:-90a}
JOBS=$(nproc 2>/dev/null || echo 4)
mkdir -p "$OUT"
cd "$ROOT" || exit 1
exec > >(tee "$OUT/gpu-check.log") 2>&1

step() { echo; echo "== $* ($(date +%T))"; }
status=0

step machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | head -3
nvcc --version | tail -1
cmake --version | head -1
gcc --version | head -1
grep PRETTY_NAME /etc/os-release

step dependencies
# the carried Debian libraries, pkg-config, NCCL (scripts/gpu-env.sh)
. scripts/gpu-env.sh
echo "pkg-config: ${PKGCONF:-none}; mpicc: $(command -v mpicc || echo none)"
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}

step build
BUILD=build-gpu
BIN=""
if [ "${FL_GPU_CHECK_DIRECT:-0}" = 1 ]; then
    echo "FL_GPU_CHECK_DIRECT=1: skipping CMake"
elif cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFL_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
        ${PKGCONF:+-DPKG_CONFIG_EXECUTABLE=$PKGCONF} >"$OUT/cmake.log" 2>&1; then
    if make -C "$BUILD" -j"$JOBS" all bench_kernels >"$OUT/build.log" 2>&1; then
        BIN=$BUILD && echo "cmake build ok"
    else
        echo "cmake build failed (first errors below, full log in build.log); building directly"
        grep -m 6 -E "error" "$OUT/build.log"
    fi
else
    echo "cmake configure failed (tail of cmake.log below); building directly"
    tail -5 "$OUT/cmake.log"
fi
if [ -z "$BIN" ]; then
    M=build-gpu-manual
    rm -rf "$M" && mkdir -p "$M/obj"
    PC="$PKGCONF"
    CF="$($PC --cflags libcjson libpcre2-8 libutf8proc yaml-0.1 cmocka)"
    LIBS="$($PC --libs libcjson libpcre2-8 libutf8proc yaml-0.1) -lm -lpthread"
    ok=1
    for f in kernels/cuda/*.cu; do
        nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_${ARCH},code=sm_${ARCH} -I. \
            -c "$f" -o "$M/obj/$(basename "$f").o" || ok=0
    done
    for f in runtime/*.c kernels/*.c kernels/cpu/*.c $(ls parallel/*.c 2>/dev/null); do
        gcc -std=gnu11 -O3 -DFL_HAVE_CUDA=1 -I. $CF -c "$f" \
            -o "$M/obj/$(echo "$f" | tr / _).o" || ok=0
    done
    ar rcs "$M/libcore.a" "$M"/obj/*.o
    CUL="-L$CUDA_HOME/lib64 -L$CUDA_HOME/targets/x86_64-linux/lib -lcublas -lcudart -lstdc++"
    for t in test_cuda_ops test_cuda_golden test_backend_ops test_decode_steps; do
        gcc -std=gnu11 -O2 -I. $CF -DFL_TEST_DATA="\"$ROOT/tests\"" -DFL_BIN="\"\"" \
            "tests/$t.c" "$M/libcore.a" $CUL $LIBS $($PC --libs cmocka) -o "$M/$t" || ok=0
    done
    nvcc -std=c++17 -O3 -gencode=arch=compute_${ARCH},code=sm_${ARCH} -I. bench/bench_kernels.cu \
        "$M/libcore.a" -lcublas $LIBS -o "$M/bench_kernels" || ok=0
    if [ $ok = 1 ]; then BIN=$M; mkdir -p "$M/tests"; mv "$M"/test_cuda_* "$M/tests/"; echo "direct build ok"; fi
fi
if [ -z "$BIN" ]; then
    echo "BUILD FAILED"; tail -40 "$OUT/build.log" 2>/dev/null; exit 1
fi

export OMP_NUM_THREADS=$JOBS
# A GPU run must not pass by skipping: the GPU tests fail when the CUDA
# backend does not start (tests/test_gpu.h).
export FL_REQUIRE_GPU=1
if [ "$BIN" = "$BUILD" ]; then
    step "ctest -L gpu"
    timeout 1200 ctest --test-dir "$BUILD" -L gpu --output-on-failure 2>&1 | tee "$OUT/ctest-gpu.log" | grep -v "^\[ RUN\|^\[       OK"
    r=${PIPESTATUS[0]}; echo "ctest -L gpu exit $r"; [ "$r" = 0 ] || status=1
else
    # the direct build has no ctest: run its test programs the way ctest would
    for t in test_cuda_ops test_cuda_golden test_backend_ops; do
        step "$t"
        timeout 300 "$BIN/tests/$t" 2>&1 | tee "$OUT/$t.log" | grep -v "^\[ RUN\|^\[       OK"
        r=${PIPESTATUS[0]}; echo "$t exit $r"; [ "$r" = 0 ] || status=1
    done
    for g in off on; do
        step "test_decode_steps --backend cuda --graphs $g"
        timeout 300 "$BIN/tests/test_decode_steps" --backend cuda --graphs $g 2>&1 | tee "$OUT/test_decode_steps-$g.log" |
            grep -v "^\[ RUN\|^\[       OK"
        r=${PIPESTATUS[0]}; echo "test_decode_steps ($g) exit $r"; [ "$r" = 0 ] || status=1
    done
fi

step bench_kernels
timeout 120 "$BIN/bench_kernels" --json "$OUT/bench_kernels.json" 2>&1 | tee "$OUT/bench_kernels.log"
r=${PIPESTATUS[0]}; echo "bench_kernels exit $r"; [ "$r" = 0 ] || status=1

step done
echo "gpu-check: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
