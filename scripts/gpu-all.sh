#!/usr/bin/env bash
# gpu-all.sh — everything the GPU machine checks, in one call, in order of
# importance (device time is scarce): build once (build-gpu, with NCCL), the
# GPU-labelled tests (FL_REQUIRE_GPU=1 ctest -L gpu), the kernel microbenchmarks, then on a
# machine with 2+ GPUs the multi-GPU correctness check
# (scripts/gpu-multi-check.sh) and the scaling runs (scripts/gpu-scaling.sh).
# Results: $OUT/summary.txt and $OUT/all.tgz (all logs and JSON; re-made
# after every step, so a run cut short still returns what it finished).
#   FL_BUDGET_S=480 bash scripts/gpu-all.sh   # start no new step after 480 s
#   FL_STEPS="tests bench moe ab multi overlap scaling"   # which parts (default: all)
#   FL_EXTRA_TARGETS="test_x ..."   # more CUDA test programs to build and run
#   FL_TESTS="test_cuda_graph ..."   # run these test programs instead of ctest -L gpu (and the extra ones)
#   FL_CTEST_ARGS="-R test_decode_steps"   # more ctest arguments (a subset of the gpu tests)
# pdl: one GPU, batch 1 with programmatic dependent launch on and off
# (FL_CUDA_TUNE=pdl=0; kernels/cuda/cuda_common.cuh) on FL_PDL_SPECS
# (preset:quant).
# profile: one GPU, ncu's kernel-by-kernel view of one batch-1 decode step
# of FL_PROFILE_SPECS (preset:quant; scripts/gpu-profile.sh).
# early: one GPU, the FL_PDL_EARLY=0 build vs default (see the step).
# envtests: with FL_ENVTEST=VAR=VALUE (e.g. FL_CUDA_TUNE=w4_gemv=bulk), the
# golden, graph and MoE tests (or FL_ENVTEST_TESTS) again with that variable
# set.
# envab: one GPU, flotilla bench of FL_ENVAB_SPECS (preset:quant:batch) with
# FL_ENVAB_VAR (default FL_CUDA_TUNE) set to each of FL_ENVAB_VALUES
# (glu_fuse=all glu_fuse=none; a value starting FL_...= sets variables
# itself: FL_CUDA_TUNE=w4_gemv=ring,glu_fuse=none+FL_MOE_DEVICE=0),
# with FL_ENVAB_ARGS added to each bench (e.g. "--temperature 0.8 --top-k 50").
# moe: one GPU, flotilla bench of the MoE presets (FL_MOE_PRESETS, batches
# FL_MOE_BATCHES) with the experts routed on the device (the default, graphs
# on) and on the host (FL_MOE_DEVICE=0).
# FL_BENCH_ARGS: extra bench_kernels arguments (--sweep-only: the W4 GEMV
# variants; FL_BENCH_LINES lines of its log shown).
# memory: one GPU, `flotilla plan` of FL_MEM_SPECS (preset:quant) against
# the device, then bench --verbose of each at batch 64, which logs the plan
# next to the measured device memory (the planner's check), at max-model-len
# FL_MEM_MAX_LEN (4096).
# batch: one GPU, fixed-batch decode of FL_BATCH_SPECS (preset:quant) at
# FL_BATCH_SIZES with FL_BATCH_PROMPT prompt tokens (large-batch speed).
# workload: one GPU, `flotilla bench --workload` (docs/bench.md) of
# FL_WL_SPECS (preset:quant:prompts:input:output[:extra flags, + for spaces]):
# the throughput a batch job gets, JSON per run.
# ab: one GPU, batch 1 of FL_AB_PRESETS (default llama-3-8b) x FL_AB_QUANT x
# FL_AB_FUSE with the q|k|v and gate|up weights fused
# (FL_FUSE=all), q|k|v only (FL_FUSE=qkv) and apart (FL_FUSE=0), w4 and bf16:
# what each fusion is worth (the default: runtime/model/model_fuse.c).
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTROOT=${OUT:-$ROOT/out}
# Logs live outside $OUT (the device tool returns a limited number of files)
# and travel in one tarball.
WORK=$(mktemp -d /tmp/fl-gpu-all.XXXXXX)
R=$WORK/all
mkdir -p "$R" "$OUTROOT"
cd "$ROOT" || exit 1
exec > >(tee "$OUTROOT/summary.txt") 2>&1
T0=$(date +%s)
BUDGET=${FL_BUDGET_S:-100000}
STEPS=${FL_STEPS:-tests envtests bench memory batch workload profile early envab moe pdl ab multi overlap scaling}
FL_EXTRA_TARGETS=${FL_EXTRA_TARGETS:-}
export FL_DEADLINE=$((T0 + BUDGET))
step() { echo; echo "== $* ($(date +%T), +$(($(date +%s) - T0)) s)"; }
# The folders, not ".": a "./" entry carries mktemp's 0700 and would
# narrow the permissions of whatever folder the archive is unpacked into.
pack() { (cd "$WORK" && tar czf "$OUTROOT/all.tgz" -- *) 2>/dev/null; }
left() { [ "$(date +%s)" -lt "$FL_DEADLINE" ] || { echo "(budget of $BUDGET s spent: skipping $1)"; return 1; }; }
want() { [[ " $STEPS " == *" $1 "* ]]; }
. scripts/gpu-env.sh
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
step "build ($NGPU GPUs, commit $(cat .deps/commit 2>/dev/null))"
gpu_configure "$R/cmake.log" || exit 1
# everything (the gpu-labelled tests are whatever tests/CMakeLists.txt labels
# gpu; a list here would go stale) and the benchmark
make -C build-gpu -j"$(nproc)" all bench_kernels $FL_EXTRA_TARGETS >"$R/build.log" 2>&1 ||
    { grep -m 10 -E "error" "$R/build.log"; pack; exit 1; }
status=0
# A GPU run must not pass by skipping: GPU tests fail when the CUDA backend
# does not start (tests/test_gpu.h).
export FL_REQUIRE_GPU=1
if want tests; then
    if [ -z "${FL_TESTS:-}" ]; then
        step "FL_REQUIRE_GPU=1 ctest -L gpu"
        # shellcheck disable=SC2086
        timeout 1500 ctest --test-dir build-gpu -L gpu ${FL_CTEST_ARGS:-} --output-on-failure >"$R/ctest-gpu.log" 2>&1
        rc=$?
        # every test's own output (the numbers a passing test prints)
        cp build-gpu/Testing/Temporary/LastTest.log "$R/ctest-gpu-output.log" 2>/dev/null
        grep -E "Test +#|tests passed|FAILED|Failed|max rel|worst rel|cases, |routing" "$R/ctest-gpu.log" | head -60
        echo "ctest -L gpu exit $rc"; [ $rc = 0 ] || status=1
    fi
    for t in ${FL_TESTS:-} $FL_EXTRA_TARGETS; do
        [ -x build-gpu/tests/$t ] || continue
        step "$t"
        timeout 240 build-gpu/tests/$t >"$R/$t.log" 2>&1
        rc=$?; grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED|ERROR|error|us |GB/s" "$R/$t.log" | head -16
        echo "$t exit $rc"; [ $rc = 0 ] || status=1
    done
    pack
fi
if want envtests && [ -n "${FL_ENVTEST:-}" ] && left "tests with $FL_ENVTEST"; then
    # the golden and graph tests again with one variable set (FL_ENVTEST,
    # e.g. FL_CUDA_TUNE=w4_gemv=bulk): a kernel choice that is not the default yet,
    # through whole models and captured decode steps
    for t in ${FL_ENVTEST_TESTS:-test_cuda_golden test_cuda_graph test_cuda_moe}; do
        step "$t with $FL_ENVTEST"
        env "$FL_ENVTEST" timeout 240 build-gpu/tests/$t >"$R/$t-envtest.log" 2>&1
        rc=$?; grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED|ERROR|error" "$R/$t-envtest.log" | head -16
        echo "$t ($FL_ENVTEST) exit $rc"; [ $rc = 0 ] || status=1
    done
    pack
fi
if want bench && left bench_kernels; then
    step bench_kernels
    timeout 180 build-gpu/bench_kernels --json "$R/bench_kernels.json" ${FL_BENCH_ARGS:-} >"$R/bench_kernels.log" 2>&1
    grep -iE "gemv|gemm|ceiling|w4|bf16|argmax|glu" "$R/bench_kernels.log" | head -${FL_BENCH_LINES:-40}
    # every backend op case timed on the CPU and CUDA backends (tests/test_backend_ops.c)
    timeout 300 build-gpu/tests/test_backend_ops --perf >"$R/backend_ops_perf.log" 2>&1 ||
        echo "test_backend_ops --perf failed (see backend_ops_perf.log)"
    pack
fi
if want memory && left "memory plan"; then
    step "memory plan against the device (1 GPU)"
    mkdir -p "$R/memory"
    total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    for spec in ${FL_MEM_SPECS:-llama-3-8b:w4 llama-3-8b:none mixtral-8x7b:w4}; do
        p_=${spec%%:*} q_=${spec##*:}
        build-gpu/flotilla plan --model "$p_" --quantize "$q_" --backend cuda --memory-budget "${total}M" \
            --max-model-len "${FL_MEM_MAX_LEN:-4096}" --output "$R/memory/plan-$p_-$q_.json" >"$R/memory/plan-$p_-$q_.txt" 2>&1
        echo "plan $p_ $q_ exit $?"; head -30 "$R/memory/plan-$p_-$q_.txt"
        timeout 200 build-gpu/flotilla bench --backend cuda --preset "$p_" --quantize "$q_" --batch 64 \
            --prompt-len 512 --gen-len 16 --max-model-len "${FL_MEM_MAX_LEN:-4096}" --verbose \
            --output "$R/memory/bench-$p_-$q_.json" >"$R/memory/bench-$p_-$q_.txt" 2>&1
        grep -E "^bench|memory|measured|predicted|KV|error" "$R/memory/bench-$p_-$q_.txt" | head -30
    done
    pack
fi
if want batch && left "large batch"; then
    step "large-batch decode (1 GPU)"
    mkdir -p "$R/batch"
    for spec in ${FL_BATCH_SPECS:-llama-3-8b:w4 llama-3-8b:none}; do
        for b in ${FL_BATCH_SIZES:-1 16 64 256 512}; do
            left "batch $b" || break
            timeout 200 build-gpu/flotilla bench --backend cuda --preset "${spec%%:*}" --quantize "${spec##*:}" \
                --batch "$b" --prompt-len "${FL_BATCH_PROMPT:-512}" --gen-len 32 \
                --output "$R/batch/${spec%%:*}-${spec##*:}-b$b.json" 2>&1 | grep -E "^bench|error"
        done
    done
    pack
fi
if want workload; then
    step "workload benchmark (1 GPU)"
    mkdir -p "$R/workload"
    specs=${FL_WL_SPECS:-llama-3-8b:w4:1000:1000:1000 llama-3-8b:none:1000:1000:1000}
    for spec in $specs; do
        IFS=: read -r p_ q_ n_ i_ o_ x_ <<<"$spec"
        left "workload $spec" || break
        x_=${x_//+/ } x_=${x_//@R/$R/workload} # @R: the results folder (e.g. --sweep-csv+@R/sweep.csv)
        tag=$(tr -c 'A-Za-z0-9_.\n-' _ <<<"$p_-$q_-n$n_-i$i_-o$o_${x_:+-$x_}")
        # shellcheck disable=SC2086
        timeout 300 build-gpu/flotilla bench --workload --backend cuda --preset "$p_" --quantize "$q_" \
            --num-prompts "$n_" --input-len "$i_" --output-len "$o_" $x_ --output "$R/workload/$tag.json" \
            >"$R/workload/$tag.txt" 2>&1
        echo "workload $spec exit $?"; grep -vE "^\s*$" "$R/workload/$tag.txt" | head -16
    done
    pack
fi
if want profile && left profile; then
    step "one decode step kernel by kernel under ncu (scripts/gpu-profile.sh)"
    # shellcheck disable=SC2086
    OUT=$WORK bash scripts/gpu-profile.sh ${FL_PROFILE_SPECS:-} || status=1
    pack
fi
if want early && left "PDL early"; then
    # The same build with -DFL_PDL_EARLY=$FL_EARLY_ALT (default 0: the
    # default build lets every successor launch before the wait, the other
    # after it; kernels/cuda/cuda_common.cuh), its golden
    # and graph tests, then batch-1 decode of FL_EARLY_SPECS (preset:quant)
    # both ways.
    step "successor launched before the wait (FL_PDL_EARLY) (1 GPU)"
    mkdir -p "$R/early"
    # shellcheck disable=SC2086
    if cmake -S "$ROOT" -B "$ROOT/build-gpu-early" $FL_GPU_CMAKE_ARGS -DCMAKE_CUDA_FLAGS=-DFL_PDL_EARLY=${FL_EARLY_ALT:-0} \
        >"$R/early/cmake.log" 2>&1 && make -C build-gpu-early -j"$(nproc)" flotilla test_cuda_golden test_cuda_graph \
        >"$R/early/build.log" 2>&1; then
        for t in test_cuda_golden test_cuda_graph; do
            timeout 240 build-gpu-early/tests/$t >"$R/early/$t.log" 2>&1
            rc=$?; grep -E "^\[  (PASSED|FAILED) |FAILED" "$R/early/$t.log" | head -4
            echo "early $t exit $rc"; [ $rc = 0 ] || status=1
        done
        for spec in ${FL_EARLY_SPECS:-llama-3-8b:w4 mixtral-8x7b:w4 qwen3-30b-a3b:w4 deepseek-v2-lite:w4 llama-3-8b:none}; do
            for bd in build-gpu build-gpu-early; do
                timeout 150 $bd/flotilla bench --backend cuda --preset "${spec%%:*}" \
                    --quantize "${spec##*:}" --batch 1 --output "$R/early/${spec%%:*}-${spec##*:}-$bd.json" 2>&1 |
                    grep -E "^bench|error" | sed "s/^/$bd: /"
            done
        done
    else
        echo "build-gpu-early failed"; grep -m 10 error "$R/early/build.log"; status=1
    fi
    pack
fi
if want envab && left "env A/B"; then
    var=${FL_ENVAB_VAR:-FL_CUDA_TUNE}
    vals=${FL_ENVAB_VALUES:-glu_fuse=all glu_fuse=none}
    step "$var = $vals (1 GPU)"
    mkdir -p "$R/envab"
    for spec in ${FL_ENVAB_SPECS:-llama-3-8b:w4:1 mixtral-8x7b:w4:1 qwen3-30b-a3b:w4:1 deepseek-v2-lite:w4:1 llama-3-8b:w4:16}; do
        IFS=: read -r p_ q_ b_ <<<"$spec"
        b_=${b_:-1}
        for v in $vals; do
            # a spec listed twice (a repeat, to see the spread) keeps both JSONs: -r2, -r3, ...
            # a value starting FL_...= is a whole setting, VAR=X[+VAR2=Y...]
            # (several variables at once); otherwise it is $var's value
            if [[ "$v" == FL_*=* ]]; then set_=${v//+/ } tag_=$(tr -c 'A-Za-z0-9_.\n-' _ <<<"$v")
            else set_="$var=$v" tag_=$(tr -c 'A-Za-z0-9_.\n-' _ <<<"$var$v"); fi
            o="$R/envab/$p_-$q_-b$b_-$tag_" r=1
            while [ -e "$o$([ $r -gt 1 ] && echo "-r$r").json" ]; do r=$((r + 1)); done
            o="$o$([ $r -gt 1 ] && echo "-r$r").json"
            # shellcheck disable=SC2086
            env $set_ timeout 150 build-gpu/flotilla bench --backend cuda --preset "$p_" --quantize "$q_" \
                --batch "$b_" ${FL_ENVAB_ARGS:-} --output "$o" 2>&1 |
                grep -E "^bench|sampling|error" | sed "s/^/$set_: /"
        done
    done
    pack
fi
if want moe && left "MoE decode"; then
    step "MoE decode, experts routed on the device vs the host (1 GPU)"
    mkdir -p "$R/moe"
    timeout 120 build-gpu/bench_kernels --moe --json "$R/moe/bench_kernels_moe.json" 2>&1 | grep -E "^moe_|ceiling"
    for preset in ${FL_MOE_PRESETS:-mixtral-8x7b qwen3-30b-a3b}; do
        for b in ${FL_MOE_BATCHES:-1 16 64}; do
            for dev in 1 0; do
                FL_MOE_DEVICE=$dev timeout 150 build-gpu/flotilla bench --backend cuda --preset "$preset" \
                    --quantize w4 --batch "$b" --output "$R/moe/$preset-w4-b$b-dev$dev.json" 2>&1 |
                    grep -E "^bench|graph|error" | sed "s/^/FL_MOE_DEVICE=$dev: /"
            done
        done
    done
    pack
fi
if want pdl && left "PDL A/B"; then
    step "programmatic dependent launch of the small kernels on / off (1 GPU)"
    mkdir -p "$R/pdl"
    for spec in ${FL_PDL_SPECS:-llama-3-8b:w4 llama-3-8b:none mixtral-8x7b:w4 qwen3-30b-a3b:w4}; do
        for pdl in 1 0; do
            FL_CUDA_TUNE=pdl=$pdl timeout 150 build-gpu/flotilla bench --backend cuda --preset "${spec%%:*}" \
                --quantize "${spec##*:}" --batch 1 --output "$R/pdl/${spec%%:*}-${spec##*:}-pdl$pdl.json" 2>&1 |
                grep "^bench" | sed "s/^/pdl=$pdl: /"
        done
    done
    pack
fi
if want ab && left "fusion A/B"; then
    step "fused vs separate q|k|v, gate|up (1 GPU)"
    mkdir -p "$R/ab"
    for preset in ${FL_AB_PRESETS:-llama-3-8b}; do
        for q in ${FL_AB_QUANT:-w4 none}; do
            for fuse in ${FL_AB_FUSE:-0 qkv all}; do
                FL_FUSE=$fuse timeout 120 build-gpu/flotilla bench --backend cuda --preset "$preset" --quantize $q \
                    --batch 1 --output "$R/ab/$preset-$q-fuse$fuse.json" 2>&1 | grep "^bench" | sed "s/^/FL_FUSE=$fuse: /"
            done
        done
    done
    pack
fi
if [ "$NGPU" -ge 2 ] && want multi && left multi-check; then
    step multi-gpu correctness
    OUT=$WORK FL_NP=$NGPU FL_MULTI_LIMIT=60 FL_MULTI_STOP_ON_HANG=1 bash scripts/gpu-multi-check.sh 2>&1 |
        grep -E "max rel diff|per position|generate tp|exit|failed|still running|gpu-multi-check|error" | grep -v "NCCL INFO"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    pack
fi
if [ "$NGPU" -ge 2 ] && want overlap && left "MoE overlap"; then
    step "MoE two-micro-batch overlap (scripts/gpu-moe-overlap.sh)"
    OUT=$WORK FL_NP=$NGPU bash scripts/gpu-moe-overlap.sh 2>&1 | grep -vE "NCCL INFO|^\s*$" | tail -24
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    pack
fi
if [ "$NGPU" -ge 2 ] && want scaling; then
    # Scaling on every power of two up to NGPU (the 1-GPU runs are made once).
    for np_ in ${FL_SCALING_NPS:-$(n=2; while [ $n -le "$NGPU" ]; do echo $n; n=$((n * 2)); done)}; do
        left "scaling on $np_ GPUs" || break
        step "scaling on $np_ GPUs"
        OUT=$WORK FL_NP=$np_ bash scripts/gpu-scaling.sh 2>&1 | tail -30
        pack
    done
fi
step done
echo "gpu-all: $([ $status = 0 ] && echo PASS || echo FAIL)"
pack
rm -rf "$WORK"
exit $status
