#!/usr/bin/env bash
# gpu-graph.sh — the decode-step overhead run on a GPU machine (H200): builds
# flotilla and the CUDA tests (dependencies and CMake configure as in
# scripts/gpu-check.sh), runs test_cuda_ops, test_cuda_golden and
# test_cuda_graph, then `flotilla bench` on llama-3-8b (w4 and bf16, batch 1
# and 16) with CUDA graphs on and off, a step-phase timing run
# (--step-timing) of each, and per-kernel durations of a 2-layer decode from
# Nsight Compute (graphs off, --clock-control none) when ncu exists.
#
#   OUT=/tmp/res bash scripts/gpu-graph.sh          # from the repository root
#
# Everything lands in $OUT/graph.tgz (JSON per bench run, logs) plus
# $OUT/summary.txt (the table printed last); the device tool returns at most
# 8 files, hence the archive.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTROOT=${OUT:-$ROOT/out}
RES=$OUTROOT/graph
ARCH=${FL_CUDA_ARCH:-90a}
JOBS=$(nproc 2>/dev/null || echo 4)
mkdir -p "$RES"
cd "$ROOT" || exit 1
exec > >(tee "$RES/gpu-graph.log") 2>&1
export NCCL_NVLS_ENABLE=0
step() { echo; echo "== $* ($(date +%T))"; }
status=0

step machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | head -4
nvcc --version | tail -1

step dependencies
# the carried Debian libraries, pkg-config, NCCL (scripts/gpu-env.sh)
. scripts/gpu-env.sh

step build
BUILD=build-gpu
T="flotilla test_cuda_ops test_cuda_golden test_cuda_graph"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DFL_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
    ${PKGCONF:+-DPKG_CONFIG_EXECUTABLE=$PKGCONF} >"$RES/cmake.log" 2>&1 || { tail -20 "$RES/cmake.log"; exit 1; }
if ! make -C "$BUILD" -j"$JOBS" $T >"$RES/build.log" 2>&1; then
    # a newer host gcc may warn where ours does not: report, then build without -Werror
    echo "build with -Werror failed:"; grep -m 6 -E "error" "$RES/build.log"
    cmake -S . -B "$BUILD" -DFL_WERROR=OFF >/dev/null 2>&1
    make -C "$BUILD" -j"$JOBS" $T >"$RES/build.log" 2>&1 || { grep -m 20 -E "error" "$RES/build.log"; exit 1; }
fi
echo "build ok"
export OMP_NUM_THREADS=$JOBS

for t in test_cuda_ops test_cuda_golden test_cuda_graph; do
    step "$t"
    timeout 150 "$BUILD/tests/$t" >"$RES/$t.log" 2>&1
    r=$?
    grep -v "^\[ RUN\|^\[       OK" "$RES/$t.log" | tail -40
    echo "$t exit $r"; [ "$r" = 0 ] || status=1
done

commit=$(cat .deps/commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
bench() { # name, then flotilla bench arguments
    local name=$1; shift
    echo "-- $name"
    timeout 120 "$BUILD/flotilla" bench --backend cuda --prompt-len 16 --gen-len 64 \
        --output "$RES/$name.json" "$@" >"$RES/$name.log" 2>&1 || { echo "$name failed"; status=1; }
    tail -3 "$RES/$name.log"
}
step bench
for q in w4 none; do
    for b in 1 16; do
        for g in on off; do
            bench "llama-3-8b-$q-b$b-graphs-$g" --preset llama-3-8b --quantize "$q" --batch "$b" --cuda-graphs "$g"
        done
    done
done
step "step phases (--step-timing: syncs between phases)"
for r in w4:1:on w4:1:off none:1:on w4:16:on w4:16:off; do
    IFS=: read -r q b g <<<"$r"
    [ "$SECONDS" -lt "${FL_GRAPH_BUDGET_S:-270}" ] || { echo "time budget spent: skipping the rest"; break; }
    bench "timing-llama-3-8b-$q-b$b-graphs-$g" --preset llama-3-8b --quantize "$q" --batch "$b" --cuda-graphs "$g" --step-timing
done

if command -v ncu >/dev/null 2>&1 && [ "$SECONDS" -lt "${FL_GRAPH_BUDGET_S:-270}" ]; then
    step "ncu per-kernel durations (2 layers, graphs off, 3 decode steps)"
    timeout $(( ${FL_GRAPH_BUDGET_S:-270} + 40 - SECONDS )) ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        "$BUILD/flotilla" bench --backend cuda --preset llama-3-8b --quantize w4 --layers 2 \
        --prompt-len 4 --gen-len 4 --cuda-graphs off >"$RES/ncu-w4-2layers.csv" 2>"$RES/ncu.err"
    echo "ncu exit $? ($(wc -l <"$RES/ncu-w4-2layers.csv") lines)"
fi

step summary
python3 - "$RES" "$commit" <<'PY' | tee "$OUTROOT/summary.txt"
import json, sys, glob, os, datetime, csv, collections
res, commit = sys.argv[1], sys.argv[2]
rows = []
for p in sorted(glob.glob(os.path.join(res, "*.json"))):
    d = json.load(open(p))
    d["commit"] = commit; d["date"] = datetime.date.today().isoformat(); d["machine"] = "nvidia-h200-x2 (1 GPU used)"
    json.dump(d, open(p, "w"))
    name = os.path.basename(p)[:-5]
    ph = d.get("phase_ms", {})
    rows.append((name, d["decode_step_ms_median"], d["decode_tok_s"], 100 * d["fraction_of_ceiling"],
                 d["copy_ceiling_GBps"], d.get("graph_replays", 0), d.get("timed_steps", 0), ph,
                 d.get("outside_forward_ms", 0)))
print("%-38s %9s %9s %7s %8s %7s" % ("run", "ms/step", "tok/s", "%ceil", "ceilGB/s", "replays"))
for r in rows:
    print("%-38s %9.3f %9.1f %7.1f %8.0f %7d" % r[:6])
print()
for r in rows:
    if r[6]:
        ph = r[7]
        print("%-38s phases ms: prep %.3f enqueue %.3f gpu_wait %.3f logits %.3f outside %.3f" %
              (r[0], ph["prep"], ph["enqueue"], ph["gpu_wait"], ph["logits"], r[8]))
p = os.path.join(res, "ncu-w4-2layers.csv")
if os.path.exists(p):
    lines = [l for l in open(p) if l.startswith('"')]
    if lines:
        rd = csv.DictReader(lines)
        per = collections.defaultdict(list)
        for row in rd:
            try:
                v = float(row["Metric Value"].replace(",", ""))
            except (KeyError, ValueError):
                continue
            unit = row.get("Metric Unit", "")
            us = v * {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, float("nan"))
            per[row["Kernel Name"][:60]].append(us)
        print("\nncu (2 layers, graphs off): kernel, launches, median us, total us")
        for k, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            s = sorted(v)
            print("  %-60s %5d %9.2f %10.1f" % (k, len(v), s[len(s) // 2], sum(v)))
PY
tar -C "$OUTROOT" -czf "$OUTROOT/graph.tgz" graph && rm -rf "$RES"
echo "gpu-graph: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
