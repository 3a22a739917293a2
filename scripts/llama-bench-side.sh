#!/usr/bin/env bash
# llama-bench-side.sh [GGUF] [THREADS...] — flotilla's CPU backend next to
# llama.cpp's llama-bench on the same GGUF (default: the demo model) at each
# thread count (default 1 2): prefill of 128 tokens and decode of 64, as
# `llama-bench -p 128 -n 64 -t T` runs them, one side-by-side table.
#
# llama.cpp comes from a pinned PyPI source release (the llama-cpp-python
# sdist vendors it under vendor/llama.cpp; scripts/llama-cpp-src.sh fetches
# it), built once into .deps/ (git-ignored)
# with only its llama-bench target. It downloads and builds for minutes, so it
# is not part of CI (docs/bench.md, "Side by side with llama.cpp").
# FLOTILLA=path picks the flotilla binary (default build/flotilla; build it
# unsanitized: scripts/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# llama-cpp-python 0.3.9 vendors a llama.cpp that knows SmolLM2's "smollm"
# pre-tokenizer and Q4_1; pinned so every table compares the same llama.cpp.
py_ver=0.3.9
prompt=128
gen=64
gguf=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
shift || true
threads=("$@")
[ ${#threads[@]} -gt 0 ] || threads=(1 2)
fl=${FLOTILLA:-build/flotilla}
dep=.deps/llama.cpp-py$py_ver
bench=$dep/build/bin/llama-bench

[ -f "$gguf" ] || { echo "llama-bench-side: no GGUF at $gguf (scripts/fetch_demo_model.sh)" >&2; exit 1; }
[ -x "$fl" ] || { echo "llama-bench-side: no flotilla binary at $fl (scripts/build.sh)" >&2; exit 1; }

if [ ! -x "$bench" ]; then
  dep=$(scripts/llama-cpp-src.sh src)
  bench=$dep/build/bin/llama-bench
  cmake -S "$dep" -B "$dep/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF >&2
  cmake --build "$dep/build" --target llama-bench -j 2 >&2
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "llama-bench-side: $(date -u +%Y-%m-%dT%H:%MZ), flotilla $(git rev-parse --short HEAD 2>/dev/null || echo '?'), llama.cpp from llama-cpp-python $py_ver"
echo "model: $gguf; prefill $prompt tokens, decode $gen tokens, batch 1"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
echo "load before: $(uptime)"
for t in "${threads[@]}"; do
  # llama.cpp: 5 repetitions each, the mean (llama-bench's avg_ts)
  "$bench" -m "$gguf" -p "$prompt" -n "$gen" -t "$t" -o json >"$out/llama-$t.json" 2>"$out/llama-$t.err" ||
    { cat "$out/llama-$t.err" >&2; exit 1; }
  # flotilla: 3 runs, the best of each number; gen + 1 tokens = gen decode
  # steps after the prefill's first token
  for r in 1 2 3; do
    "$fl" bench --model "$gguf" --backend cpu --threads "$t" --batch 1 --prompt-len "$prompt" \
      --gen-len $((gen + 1)) --output "$out/fl-$t-$r.json" >"$out/fl-$t-$r.out" 2>&1 ||
      { cat "$out/fl-$t-$r.out" >&2; exit 1; }
  done
done
echo "load after: $(uptime)"
python3 - "$out" "$prompt" "$gen" "${threads[@]}" <<'EOF'
import json, sys
out, prompt, gen, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
rows = []
print()
print(f"{'engine':<10} {'threads':>7} {'prefill tok/s':>14} {'decode tok/s':>13} {'ratio pp':>9} {'ratio tg':>9}")
for t in threads:
    ll = json.load(open(f"{out}/llama-{t}.json"))
    pp = next(r["avg_ts"] for r in ll if r["n_prompt"] == prompt and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in ll if r["n_gen"] == gen and r["n_prompt"] == 0)
    fl = [json.load(open(f"{out}/fl-{t}-{r}.json")) for r in (1, 2, 3)]
    fpp = max(j["prefill_tok_s"] for j in fl)
    ftg = max(j["decode_tok_s"] for j in fl)
    best = max(fl, key=lambda j: j["decode_tok_s"])
    print(f"{'llama.cpp':<10} {t:>7} {pp:>14.1f} {tg:>13.1f} {'':>9} {'':>9}")
    print(f"{'flotilla':<10} {t:>7} {fpp:>14.1f} {ftg:>13.1f} {fpp / pp:>9.2f} {ftg / tg:>9.2f}")
    rows.append((t, best))
print("\nratio = flotilla / llama.cpp; llama.cpp: mean of 5 repetitions (llama-bench), flotilla: best of 3 runs")
for t, j in rows:
    print(f"flotilla {t} thread(s): decode reads {j['weight_bytes_per_step'] / 1e6:.1f} MB weights + "
          f"{j['kv_bytes_per_step'] / 1e6:.2f} MB KV a step = {100 * j['fraction_of_read_ceiling']:.1f}% of the "
          f"{j['read_ceiling_GBps']:.1f} GB/s read ceiling ({100 * j['fraction_of_ceiling']:.1f}% of the "
          f"{j['copy_ceiling_GBps']:.1f} GB/s copy ceiling); prefill {j['prefill_GFLOPs']:.1f} GFLOP/s")
EOF
