#!/usr/bin/env bash
# ptxas-report.sh BUILD_DIR [cmake args...] — builds the CUDA backend and the
# kernel benchmark in BUILD_DIR with `-Xptxas -v`, recompiling every CUDA
# object, and prints one sorted line per compiled kernel: source file,
# function, stack frame, spill stores / loads, and ptxas' "Used" line
# (registers, barriers, shared memory, constant memory). Diffing two reports
# (before and after a change) shows which kernels a change touched, on a
# machine without a GPU. The build log is kept in BUILD_DIR/ptxas-build.log.
# ptxas-report.sh --log FILE — the same report from a build log captured
# with -Xptxas -v (objects' output kept together: make -O or ninja).
set -euo pipefail
cd "$(dirname "$0")/.."
report() {
  awk -v q="'" '
    /Building CUDA object/ { src = $NF; sub(/.*\//, "", src); sub(/\.o$/, "", src) }
    /Compiling entry function/ { fn = $0; sub(".*function " q, "", fn); sub(q ".*", "", fn) }
    /Function properties for/ { pf = $NF }
    /bytes stack frame/ { st[pf] = $1; ss[pf] = $5; sl[pf] = $9 }
    /ptxas info *: Used [0-9]+ registers/ && fn != "" {
      used = $0; sub(/.*: Used /, "", used); gsub(/, /, ",", used); gsub(/ /, "_", used)
      printf "%s %s stack=%s spill_st=%s spill_ld=%s used=%s\n", src, fn, \
        (fn in st ? st[fn] : "?"), (fn in ss ? ss[fn] : "?"), (fn in sl ? sl[fn] : "?"), used
      fn = ""
    }
  ' "$1" | LC_ALL=C sort
}
if [ "${1:-}" = --log ]; then
  report "${2:?usage: ptxas-report.sh --log FILE}"
  exit 0
fi
dir=${1:?usage: ptxas-report.sh BUILD_DIR [cmake args...] | --log FILE}
shift
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFL_CUDA=ON \
  -DCMAKE_CUDA_FLAGS="-Xptxas -v" "$@" >/dev/null
# Every CUDA object is rebuilt so that the report is complete, not only the
# files an incremental build would touch.
find "$dir" -name '*.cu.o' -delete
# Output is synchronized per object (make -O; ninja buffers by itself), so
# the lines of two parallel nvcc runs never interleave.
sync_flag=()
if grep -q '^CMAKE_GENERATOR:INTERNAL=Unix Makefiles' "$dir/CMakeCache.txt"; then
  sync_flag=(-- --output-sync=target)
fi
set +e
cmake --build "$dir" -j "$(nproc)" --target fl_kernels_cuda bench_kernels "${sync_flag[@]}" \
  >"$dir/ptxas-build.log" 2>&1
rc=$?
set -e
if [ "$rc" != 0 ]; then
  grep -E 'error|Error' "$dir/ptxas-build.log" | head -40 >&2
  echo "ptxas-report.sh: building $dir failed (exit $rc); log in $dir/ptxas-build.log" >&2
  exit 1
fi
report "$dir/ptxas-build.log"
