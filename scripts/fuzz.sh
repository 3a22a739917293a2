#!/usr/bin/env bash
# fuzz.sh [SECONDS_PER_TARGET] [TARGET...] — builds the libFuzzer targets
# (fuzz/fuzz_*.c) with clang, ASan and UBSan into build-fuzz/ and runs each
# for SECONDS_PER_TARGET (default 30) from its seeds (fuzz/corpus/<target>/)
# and past crashes (fuzz/regress/<target>/). TARGET names a subset (e.g.
# request tokenizer); default all. New coverage goes to
# build-fuzz/corpus/<target>/, crashes to build-fuzz/crash/<target>/. Fails
# on the first crash, leak, timeout or out-of-memory: fix the parser, then
# copy the crash input into fuzz/regress/<target>/ so ctest replays it.
# FL_FUZZ_ARGS adds libFuzzer flags (e.g. -runs=1000000 instead of a time).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
shift || true
dir=build-fuzz
cmake -S . -B "$dir" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFL_CUDA=OFF \
  -DFL_FUZZ=ON >/dev/null
set +e
cmake --build "$dir" -j "$(nproc)" --target fuzzers 2>&1 | grep -vE '^\[|^-- |Building|Linking|Built target|Scanning'
rc=${PIPESTATUS[0]}
set -e
[ "$rc" = 0 ] || { echo "fuzz.sh: building the fuzz targets failed (exit $rc)" >&2; exit 1; }

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for f in fuzz/fuzz_*.c; do t=${f#fuzz/fuzz_}; targets+=("${t%.c}"); done
fi
# leaks are bugs too; libFuzzer stops at the first report of any kind
export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export OMP_NUM_THREADS=1 HWLOC_COMPONENTS=-pci
failed=()
for t in "${targets[@]}"; do
  exe=$dir/fuzz/fuzz_$t
  [ -x "$exe" ] || { echo "fuzz.sh: no fuzz target $t ($exe)" >&2; exit 1; }
  mkdir -p "$dir/corpus/$t" "$dir/crash/$t"
  seeds=()
  for d in fuzz/corpus/"$t" fuzz/regress/"$t"; do [ -d "$d" ] && seeds+=("$d"); done
  log=$dir/fuzz_$t.log
  start=$(date +%s)
  set +e
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb bounds a blow-up
  "$exe" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$dir/crash/$t/" ${FL_FUZZ_ARGS:-} "$dir/corpus/$t" "${seeds[@]}" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -1)
  echo "fuzz_$t: ${execs:-?} executions in $(($(date +%s) - start)) s, ${cov:-cov ?}, exit $rc"
  if [ "$rc" != 0 ]; then
    grep -E 'ERROR|SUMMARY|Test unit written|deadly signal|==[0-9]+==' "$log" | head -20 >&2
    failed+=("$t")
  fi
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz.sh: crashes in: ${failed[*]} (logs $dir/fuzz_<target>.log, inputs $dir/crash/<target>/)" >&2
  exit 1
fi
