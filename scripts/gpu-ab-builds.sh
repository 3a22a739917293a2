#!/usr/bin/env bash
# gpu-ab-builds.sh — an A/B of two builds in one device call: "a" is this
# checkout as it is, "b" the same with FL_AB_PATCH applied (patch -p1, e.g.
# an experiment kept in bench/results/) and/or configured with
# FL_AB_CMAKE_ARGS (e.g. -DCMAKE_CUDA_FLAGS=-DFL_W4_DENORM=0). flotilla bench
# runs every spec of FL_AB_SPECS FL_AB_REPS times, a then b each time, so
# the machine's drift (the start moves a step by a few percent) reaches both
# sides alike; a knob (FL_ENVAB_*, gpu-all.sh) cannot time code whose mere
# presence changes the kernels (the knob's off state still carries the new code).
#
#   FL_AB_PATCH=bench/results/X/exp.patch bash scripts/gpu-ab-builds.sh
#   FL_AB_CMAKE_ARGS=-DCMAKE_CUDA_FLAGS=-DFL_W4_DENORM=0 FL_AB_SPECS="llama-3-8b:w4:1" bash scripts/gpu-ab-builds.sh
#
#   FL_AB_SPECS    preset:quant:batch ... (default llama-3-8b:w4:1 llama-3-8b:w4:16)
#   FL_AB_REPS     runs of each spec and side (default 3)
#   FL_AB_ENV      VAR=VALUE ... set for both sides' benches
#   FL_AB_ARGS     more flotilla bench arguments (both sides)
#   FL_AB_BACKEND  cuda (default) or cpu (a local check of the script on the
#                  tiny presets: FL_AB_SPECS="tiny:none:1")
# Output: the table on stdout and in $OUT/ab.txt (decode-step medians in ms,
# b's median over a's), each bench JSON in $OUT/ab/ (default OUT: out/ab-builds).
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out/ab-builds}
BACKEND=${FL_AB_BACKEND:-cuda}
SPECS=${FL_AB_SPECS:-llama-3-8b:w4:1 llama-3-8b:w4:16}
REPS=${FL_AB_REPS:-3}
PATCHF=${FL_AB_PATCH:-}
mkdir -p "$OUT/ab"
cd "$ROOT" || exit 1
[ -z "$PATCHF" ] && [ -z "${FL_AB_CMAKE_ARGS:-}" ] &&
    { echo "gpu-ab-builds: set FL_AB_PATCH and/or FL_AB_CMAKE_ARGS (b would equal a)" >&2; exit 2; }
case $PATCHF in "" | /*) ;; *) PATCHF=$ROOT/$PATCHF ;; esac # relative to the repository root
[ -z "$PATCHF" ] || [ -f "$PATCHF" ] || { echo "gpu-ab-builds: no patch file $PATCHF" >&2; exit 2; }
JOBS=$(nproc 2>/dev/null || echo 4)
if [ "$BACKEND" = cuda ]; then
    . scripts/gpu-env.sh
    ARGS="$FL_GPU_CMAKE_ARGS"
else
    ARGS="-DCMAKE_BUILD_TYPE=RelWithDebInfo -DFL_CUDA=OFF -DFL_WERROR=OFF"
fi
# b's tree: a copy of the checkout without its build folders, patched
B=$(mktemp -d /tmp/fl-ab.XXXXXX)
trap 'rm -rf "$B"' EXIT
tar --exclude='./build*' --exclude=./.git --exclude=./out --exclude=./models -cf - . | tar -xf - -C "$B" ||
    { echo "gpu-ab-builds: copying the checkout failed" >&2; exit 1; }
ln -s "$ROOT/models" "$B/models" 2>/dev/null
if [ -n "$PATCHF" ]; then
    (cd "$B" && patch -s -p1 <"$PATCHF") || { echo "gpu-ab-builds: $PATCHF does not apply" >&2; exit 1; }
fi
echo "== building a (this checkout) and b (${PATCHF:+patch $PATCHF}${PATCHF:+${FL_AB_CMAKE_ARGS:+, }}${FL_AB_CMAKE_ARGS:-})"
# shellcheck disable=SC2086
cmake -S "$ROOT" -B "$ROOT/build-ab-a" $ARGS >"$OUT/cmake-a.log" 2>&1 &&
    cmake -S "$B" -B "$B/build-ab-b" $ARGS ${FL_AB_CMAKE_ARGS:-} >"$OUT/cmake-b.log" 2>&1 ||
    { tail -20 "$OUT"/cmake-*.log; exit 1; }
half=$(((JOBS + 1) / 2))
make -C "$ROOT/build-ab-a" -j"$half" flotilla >"$OUT/build-a.log" 2>&1 &
pa=$!
make -C "$B/build-ab-b" -j"$half" flotilla >"$OUT/build-b.log" 2>&1
rb=$?
wait $pa
ra=$?
[ $ra = 0 ] && [ $rb = 0 ] || { grep -m 10 -E "error" "$OUT"/build-*.log; exit 1; }
for spec in $SPECS; do
    IFS=: read -r p_ q_ b_ <<<"$spec"
    for r in $(seq 1 "$REPS"); do
        for side in a b; do
            bin="$ROOT/build-ab-a/flotilla"
            [ $side = b ] && bin="$B/build-ab-b/flotilla"
            o="$OUT/ab/$side-$p_-$q_-b${b_:-1}-r$r.json"
            # shellcheck disable=SC2086
            env ${FL_AB_ENV:-} timeout 300 "$bin" bench --backend "$BACKEND" --preset "$p_" --quantize "$q_" \
                --batch "${b_:-1}" ${FL_AB_ARGS:-} --output "$o" >"$OUT/ab/$side-$p_-$q_-b${b_:-1}-r$r.log" 2>&1 ||
                echo "gpu-ab-builds: $side $spec run $r failed (see its log)" >&2
        done
    done
done
# the table: each side's medians per spec, and b's median of them over a's
python3 - "$OUT/ab" "$REPS" "b: ${PATCHF:+$PATCHF }${FL_AB_CMAKE_ARGS:-}" $SPECS <<'PY' | tee "$OUT/ab.txt"
import json, os, statistics, sys
d, reps, what, specs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
print(f"decode step medians, ms (a: this checkout; {what})")
print(f"{'spec':28} {'a':26} {'b':26} b/a")
for spec in specs:
    p, q, b = (spec.split(":") + ["1"])[:3]
    side = {}
    for s in "ab":
        files = [f"{d}/{s}-{p}-{q}-b{b or 1}-r{r}.json" for r in range(1, reps + 1)]
        side[s] = [json.load(open(f))["decode_step_ms_median"] for f in files
                   if os.path.exists(f) and os.path.getsize(f)]
    ratio = "%.3f" % (statistics.median(side["b"]) / statistics.median(side["a"])) if side["a"] and side["b"] else "-"
    print(f"{spec:28} {' '.join('%.3f' % v for v in side['a']):26} {' '.join('%.3f' % v for v in side['b']):26} {ratio}")
PY
