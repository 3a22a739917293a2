#!/usr/bin/env bash
# gpu-multi-check.sh — tensor/expert parallelism over NCCL on a multi-GPU
# machine (issue 6, correctness part): for golden fixtures, `flotilla logits`
# on N GPUs (mpirun -np N --tp N [--ep E]) against the same on one GPU.
# Run after scripts/gpu-check.sh and scripts/gpu-nccl-check.sh (which build
# build-gpu/ with NCCL). Keep NCCL_NVLS_ENABLE=0.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out}
cd "$ROOT" || exit 1
NP=${FL_NP:-2}
PREFIX=$ROOT/.deps/prefix
NCCL_PY=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null)
export LD_LIBRARY_PATH=$NCCL_PY/lib:$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
make -C build-gpu -j"$(nproc)" flotilla >"$OUT/multi-build.log" 2>&1 ||
    { cmake -S . -B build-gpu -DFL_WERROR=OFF >/dev/null 2>&1; make -C build-gpu -j"$(nproc)" flotilla >>"$OUT/multi-build.log" 2>&1; } ||
    { grep -m 10 error "$OUT/multi-build.log"; exit 1; }
fl=build-gpu/flotilla
echo '[7, 100, 33, 250, 1, 99, 42, 180, 5, 77, 13]' >/tmp/ids.json
status=0
for spec in llama:1 qwen2:1 mixtral:1 mixtral:2 qwen3_moe:2; do
    IFS=: read -r fx ep <<<"$spec"
    m=tests/golden/$fx
    timeout 120 $fl logits --model $m --input-ids /tmp/ids.json --output /tmp/one.f32 --backend cuda || { echo "$fx: 1 GPU failed"; status=1; continue; }
    if timeout 180 mpirun --allow-run-as-root -np $NP -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE \
        $fl logits --model $m --input-ids /tmp/ids.json --output /tmp/many.f32 --backend cuda \
        --tp $NP --ep $ep --verbose >/tmp/multi.log 2>&1; then
        python3 - $m/config.json <<'PY' || status=1
import json, sys, numpy as np
V = json.load(open(sys.argv[1]))["vocab_size"]
a = np.fromfile("/tmp/one.f32", np.float32).reshape(-1, V)
b = np.fromfile("/tmp/many.f32", np.float32).reshape(-1, V)
err = (np.abs(a - b).max(1) / np.abs(a).max(1)).max()
print(f"{sys.argv[1].split('/')[-2]}: max rel diff {err:.2e} vs 1 GPU, argmax equal {bool((a.argmax(1)==b.argmax(1)).all())}")
sys.exit(0 if err < 5e-2 else 1)
PY
    else
        echo "$fx np=$NP ep=$ep failed:"; tail -15 /tmp/multi.log; status=1
    fi
done
echo "gpu-multi-check: $([ $status = 0 ] && echo PASS || echo FAIL)"
exit $status
