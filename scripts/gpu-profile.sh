#!/usr/bin/env bash
# gpu-profile.sh — one decode step of flotilla bench kernel by kernel under
# Nsight Compute (ncu, Firecracker machines only: KINDS.md). bench marks
# its last decode step as the profiler's range (FL_BENCH_PROFILE_LAST=1)
# and ncu starts with profiling off, so only that step's kernels are
# replayed (profiling the whole run took ~2 min a dense preset and more
# than 300 s for Qwen3-30B-A3B), after
# build-gpu/ is built (scripts/gpu-all.sh does that). For each spec
# (preset:quant[:batch], batch 1 by default), bench runs once plain (its step time) and once under ncu
# with a short generation; scripts/ncu_step.py prints the last step's
# kernels: time each, DRAM bytes, % of the copy ceiling, and the measured
# step against their cold, serial sum.
#   OUT=... bash scripts/gpu-profile.sh [PRESET:QUANT[:BATCH] ...]
# FL_PROFILE_PROMPT: prompt tokens a sequence (default: bench's 16 for the
# timed run, 4 under ncu; 1000 shows a large batch's attention at a
# workload's context length). FL_PROFILE_ARGS: more bench arguments for
# both runs (e.g. "--kv-cache-dtype fp8").
# FL_BUILD: the build folder to profile (default build-gpu; an A/B's
# second build, e.g. build-old); FL_PROFILE_TAG: added to the file names.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out}/profile
mkdir -p "$OUT"
cd "$ROOT" || exit 1
B=${FL_BUILD:-build-gpu}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "gpu-profile: no ncu on this machine"; exit 1; }
# time and DRAM bytes a kernel; the share of cycles a scheduler issued and
# the warps eligible to issue (latency bound or issue bound: ncu_step.py)
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
METRICS=$METRICS,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_eligible.avg.per_cycle_active
status=0
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(llama-3-8b:w4 mixtral-8x7b:w4 qwen3-30b-a3b:w4)
for s in "${specs[@]}"; do
    IFS=: read -r p q b <<<"$s"
    b=${b:-1} name=$p-$q-b$b${FL_PROFILE_TAG:-} plen=${FL_PROFILE_PROMPT:-}
    glen=$((3 + b * ${plen:-4} / 4096))
    timeout 150 $B/flotilla bench --backend cuda --preset "$p" --quantize "$q" --batch "$b" \
        ${plen:+--prompt-len "$plen"} ${FL_PROFILE_ARGS:-} --output "$OUT/$name.json" >"$OUT/$name.log" 2>&1 ||
        { echo "$name: bench failed"; tail -3 "$OUT/$name.log"; status=1; continue; }
    grep "^bench" "$OUT/$name.log"
    read -r step ceil < <(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d.get('decode_step_ms_median', 0), d.get('copy_ceiling_GBps', 0))" "$OUT/$name.json")
    # --gen-len 3: prefill and two decode steps, the last one profiled
    # (more where chunked prefill takes several steps: bench profiles the
    # last step of the whole batch, before the first sequences finish);
    # --cache-control all: every kernel starts from a cold L2, as the
    # weights do in a real step
    FL_BENCH_PROFILE_LAST=1 timeout 300 "$NCU" --profile-from-start off --clock-control none --cache-control all \
        --csv --print-units base \
        --metrics "$METRICS" \
        --log-file "$OUT/$name-ncu.csv" $B/flotilla bench --backend cuda --preset "$p" --quantize "$q" \
        --batch "$b" --prompt-len "${plen:-4}" ${FL_PROFILE_ARGS:-} --gen-len "$glen" >"$OUT/$name-ncu.log" 2>&1 ||
        { echo "$name: ncu failed"; tail -5 "$OUT/$name-ncu.log"; status=1; continue; }
    python3 scripts/ncu_step.py "$OUT/$name-ncu.csv" --ceiling-gbps "${ceil:-0}" --step-ms "${step:-0}" \
        >"$OUT/$name-step.txt" 2>&1 || status=1
    head -"${FL_PROFILE_LINES:-24}" "$OUT/$name-step.txt"
done
exit $status
