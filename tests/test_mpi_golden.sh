#!/usr/bin/env bash
# test_mpi_golden.sh FLOTILLA SRC — tensor, expert and data parallelism on
# the CPU backend under mpirun: for every golden architecture and each
# (np, tp, ep) layout that divides it (dp = np / tp; dp > 1 runs replicas,
# and MoE layers then exchange routed tokens all-to-all over ep groups that
# span replicas), `flotilla logits` must write the single-rank logits within
# 1e-5 relative (per position, max |diff| / max |ref|); greedy generation
# on several ranks (tp 3; dp 2 with several prompts so both replicas work,
# and with one prompt so one replica idles; MoE fixtures with a byte-level
# tokenizer under dp 2 / ep spanning replicas) must equal one rank's output;
# layouts that do not divide must be refused naming the numbers. (The
# group-32 quantized fixtures cannot run tp 2: down_proj has 160 inputs, 80
# a rank; llama_ct_channel has one group per row and splits anywhere; the
# GPTQ fixtures are 64 / 128 wide, whole groups of 32 a rank; FP8 weights
# split anywhere, llama_fp8_block's tp 2 and 4 cutting its 128 x 128 scale
# tiles, qwen2_moe_fp8_block's its 8 x 8 expert and shared-expert tiles.)
# (One rank is held to transformers' logits by tests/test_golden.c, so every
# layout here is too.)
# Prints "N passed, M failed".
set -u
fl=$1
src=$2
demo=${FL_DEMO_GGUF:-$src/models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
# Open MPI keeps allocations LeakSanitizer cannot attribute (see tests/CMakeLists.txt)
export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0
mpi() { timeout 120 mpirun --oversubscribe --bind-to none -np "$@"; }
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   - $1"; }
bad() { fail=$((fail + 1)); echo "FAIL - $1"; }

close() { # a.f32 b.f32 vocab
  python3 - "$1" "$2" "$3" <<'PY'
import array, sys
a, b, V = array.array("f"), array.array("f"), int(sys.argv[3])
a.frombytes(open(sys.argv[1], "rb").read())
b.frombytes(open(sys.argv[2], "rb").read())
assert len(a) == len(b) and len(a) % V == 0, (len(a), len(b))
worst = 0.0
for t in range(len(a) // V):
    ra, rb = a[t * V:(t + 1) * V], b[t * V:(t + 1) * V]
    den = max(abs(x) for x in ra) or 1.0
    worst = max(worst, max(abs(x - y) for x, y in zip(ra, rb)) / den)
print(f"max rel diff {worst:.2e}")
sys.exit(0 if worst <= 1e-5 else 1)
PY
}

prompt='[7, 100, 33, 250, 1, 99, 42, 180, 5, 77, 13]'
echo "$prompt" >"$tmp/ids.json"
# fixture : layouts "np,tp,ep" that divide it
# (tp < np: dp = np / tp replicas; with ep > 1 the ep groups span replicas
# when ep > tp, e.g. "2,1,2" = tp 1 dp 2 ep 2, "4,2,4" = tp 2 dp 2 ep 4)
declare -A layouts=(
  [llama]="2,2,1 4,4,1 2,1,1 4,2,1"
  [qwen2]="2,2,1 4,2,1"
  [llama_tied_rope3]="2,2,1"
  [llama_ct_channel]="2,2,1 4,4,1"
  [llama_gptq]="2,2,1"
  [llama_gptq_act]="2,2,1"
  [llama_gptq_chan]="2,2,1"
  [llama_ct_fp8]="2,2,1 4,4,1"
  [llama_ct_fp8_tensor]="2,2,1"
  [llama_fp8_tensor]="2,2,1"
  [llama_fp8_block]="2,2,1 4,4,1"
  [mixtral]="2,2,1 2,2,2 4,4,2 4,4,4 2,1,2 4,2,4"
  [qwen2_moe]="2,2,2 4,4,4 4,4,1 2,1,2 4,2,4"
  [qwen3_moe]="2,2,2 4,4,2 2,1,2 4,1,4"
  [qwen2_moe_ct_fp8]="2,2,1 2,2,2 4,2,4"
  [qwen2_moe_fp8_block]="2,2,2 4,4,4 2,1,2"
  [deepseek_v2]="2,2,1 2,2,2 4,4,4 2,1,2 4,2,4"
  [deepseek_v2_lite]="2,2,1 2,2,2 4,4,1 4,2,2"
)
for fx in "${!layouts[@]}"; do
  model=$src/tests/golden/$fx
  V=$(python3 -c "import json; print(json.load(open('$model/config.json'))['vocab_size'])")
  "$fl" logits --model "$model" --input-ids "$tmp/ids.json" --output "$tmp/one.f32" --backend cpu || { bad "$fx single rank"; continue; }
  for lay in ${layouts[$fx]}; do
    IFS=, read -r np tp ep <<<"$lay"
    dp=$((np / tp))
    name="$fx np=$np tp=$tp ep=$ep"
    dpflag=()
    [ "$dp" -gt 1 ] && { dpflag=(--dp "$dp"); name="$name dp=$dp"; }
    rm -f "$tmp/many.f32"
    if mpi "$np" "$fl" logits --model "$model" --input-ids "$tmp/ids.json" --output "$tmp/many.f32" \
         --backend cpu --tp "$tp" --ep "$ep" "${dpflag[@]}" >"$tmp/log" 2>&1 &&
         msg=$(close "$tmp/one.f32" "$tmp/many.f32" "$V"); then
      ok "$name ($msg)"
    else
      bad "$name: $(tail -3 "$tmp/log") ${msg:-}"
    fi
  done
done

# --quantize fp8: data-parallel replicas hold whole weights, so dp 2 must
# give one rank's logits (1e-5); tp 2 quantizes a row-parallel linear's
# activations per rank slice (docs/engine.md), so it is checked to run to
# finite logits only, its codes being tp 1's (test_fp8_linear).
model=$src/tests/golden/llama
V=$(python3 -c "import json; print(json.load(open('$model/config.json'))['vocab_size'])")
if "$fl" logits --model "$model" --input-ids "$tmp/ids.json" --output "$tmp/one.f32" --backend cpu --quantize fp8 &&
   mpi 2 "$fl" logits --model "$model" --input-ids "$tmp/ids.json" --output "$tmp/many.f32" --backend cpu \
     --quantize fp8 --tp 1 --dp 2 >"$tmp/log" 2>&1 && msg=$(close "$tmp/one.f32" "$tmp/many.f32" "$V"); then
  ok "llama --quantize fp8 np=2 dp=2 ($msg)"
else
  bad "llama --quantize fp8 dp 2: $(tail -3 "$tmp/log") ${msg:-}"
fi
rm -f "$tmp/many.f32"
if mpi 2 "$fl" logits --model "$model" --input-ids "$tmp/ids.json" --output "$tmp/many.f32" --backend cpu \
     --quantize fp8 --tp 2 >"$tmp/log" 2>&1 &&
   python3 -c "import array,math,sys; a=array.array('f'); a.frombytes(open(sys.argv[1],'rb').read()); sys.exit(0 if a and all(map(math.isfinite,a)) else 1)" "$tmp/many.f32"; then
  ok "llama --quantize fp8 np=2 tp=2 runs to finite logits"
else
  bad "llama --quantize fp8 tp 2: $(tail -3 "$tmp/log")"
fi

# layouts that do not divide are refused, once, naming the numbers, and nothing hangs
mpi 3 "$fl" logits --model "$src/tests/golden/llama" --input-ids "$tmp/ids.json" --output "$tmp/x.f32" \
  --backend cpu >"$tmp/log" 2>&1
rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c 'not divisible' "$tmp/log")" -eq 1 ] && grep -q "8" "$tmp/log"; then
  ok "tp 3 refused for 8 heads ($(grep 'not divisible' "$tmp/log" | head -1))"
else
  bad "tp 3 refusal (rc=$rc): $(cat "$tmp/log")"
fi
mpi 2 "$fl" logits --model "$src/tests/golden/llama_awq" --input-ids "$tmp/ids.json" --output "$tmp/x.f32" \
  --backend cpu >"$tmp/log" 2>&1
rc=$?
if [ $rc -ne 0 ] && grep -q "group" "$tmp/log"; then
  ok "AWQ group 32 cannot split 160 columns over 2 ranks: refused ($(grep -m1 group "$tmp/log"))"
else
  bad "AWQ split refusal (rc=$rc): $(cat "$tmp/log")"
fi

# replica counts that do not divide the world are refused, once, naming the numbers
mpi 4 "$fl" logits --model "$src/tests/golden/llama" --input-ids "$tmp/ids.json" --output "$tmp/x.f32" \
  --backend cpu --tp 2 --dp 3 >"$tmp/log" 2>&1
rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c 'tp 2 x dp 3 = 6 does not equal world size 4' "$tmp/log")" -eq 1 ]; then
  ok "tp 2 x dp 3 on 4 ranks refused once"
else
  bad "tp 2 x dp 3 refusal (rc=$rc): $(cat "$tmp/log")"
fi
mpi 3 "$fl" logits --model "$src/tests/golden/llama" --input-ids "$tmp/ids.json" --output "$tmp/x.f32" \
  --backend cpu --dp 2 >"$tmp/log" 2>&1
rc=$?
if [ $rc -ne 0 ] && [ "$(grep -c 'world size 3 is not divisible by dp 2' "$tmp/log")" -eq 1 ]; then
  ok "dp 2 on 3 ranks refused once"
else
  bad "dp 2 on 3 ranks refusal (rc=$rc): $(cat "$tmp/log")"
fi

# one rank failing after the others are up ends the whole job: non-zero exit,
# well within the timeout, the message exactly once
start=$(date +%s)
FL_TEST_FAIL_RANK=1 mpi 2 "$fl" logits --model "$src/tests/golden/qwen2" --input-ids "$tmp/ids.json" \
  --output "$tmp/x.f32" --backend cpu >"$tmp/log" 2>&1
rc=$?
took=$(($(date +%s) - start))
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -lt 60 ] && [ "$(grep -c 'injected failure' "$tmp/log")" -eq 1 ]; then
  ok "rank 1 failing ends the job in ${took}s, message once"
else
  bad "rank failure (rc=$rc, ${took}s): $(cat "$tmp/log")"
fi

# greedy generation on 3 ranks (9 heads, 3 KV heads, 1536 columns split 3 ways) equals 1 rank
if [ -f "$demo" ]; then
  cat >"$tmp/req.jsonl" <<'JSONL'
{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8}}
{"custom_id": "b", "body": {"prompt": "Once upon a time", "max_tokens": 8}}
JSONL
  "$fl" generate --output-format compact --model "$demo" --input "$tmp/req.jsonl" --output "$tmp/one.jsonl" --backend cpu 2>/dev/null
  mpi 3 "$fl" generate --output-format compact --model "$demo" --input "$tmp/req.jsonl" --output "$tmp/three.jsonl" --backend cpu \
    >"$tmp/log" 2>&1
  if [ $? -eq 0 ] && [ "$(sort "$tmp/one.jsonl")" = "$(sort "$tmp/three.jsonl")" ] && [ -s "$tmp/one.jsonl" ]; then
    ok "demo model greedy generate on 3 ranks equals 1 rank"
  else
    bad "demo generate on 3 ranks: $(cat "$tmp/log") / $(cat "$tmp/three.jsonl")"
  fi
  # sampled requests on 3 ranks: the vocabulary shards are gathered and the
  # backend samples them (FL_SAMPLE_ON_DEVICE=1, the default) or the host
  # does (=0); the same draws give the same text, and the summary says
  # which route ran
  cat >"$tmp/sreq.jsonl" <<'JSONL'
{"custom_id": "a", "body": {"prompt": "What is the capital of France?", "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 3}}
{"custom_id": "b", "body": {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.1, "repetition_penalty": 1.3, "min_p": 0.02, "seed": 5}}
JSONL
  for on in 1 0; do
    FL_SAMPLE_ON_DEVICE=$on mpi 3 -x FL_SAMPLE_ON_DEVICE "$fl" generate --output-format compact --model "$demo" --input "$tmp/sreq.jsonl" \
      --output "$tmp/s$on.jsonl" --backend cpu >"$tmp/slog$on" 2>&1 || bad "sampled generate on 3 ranks (FL_SAMPLE_ON_DEVICE=$on): $(tail -3 "$tmp/slog$on")"
  done
  # and with dp 2 (each replica's rows travel with its plan; its tp rank 0 samples)
  FL_SAMPLE_ON_DEVICE=1 mpi 2 -x FL_SAMPLE_ON_DEVICE "$fl" generate --output-format compact --model "$demo" --input "$tmp/sreq.jsonl" \
    --output "$tmp/sdp.jsonl" --backend cpu --dp 2 >"$tmp/slogdp" 2>&1 || bad "sampled generate with dp 2: $(tail -3 "$tmp/slogdp")"
  sampled_there='steps +[0-9]+ \(0 greedy picked where the logits are, [1-9][0-9]* sampled there\)'
  if [ -s "$tmp/s1.jsonl" ] && [ "$(sort "$tmp/s1.jsonl")" = "$(sort "$tmp/s0.jsonl")" ] &&
    grep -Eq "$sampled_there" "$tmp/slog1" && grep -q ", 0 sampled there" "$tmp/slog0"; then
    ok "demo model sampled generate on 3 ranks: sampled by the backend equals the host sampler"
  else
    bad "sampled generate on 3 ranks: $(grep steps "$tmp/slog1" "$tmp/slog0") / $(cat "$tmp/s1.jsonl" "$tmp/s0.jsonl")"
  fi
  if [ -s "$tmp/sdp.jsonl" ] && [ "$(sort "$tmp/sdp.jsonl")" = "$(sort "$tmp/s0.jsonl")" ] &&
    grep -Eq "$sampled_there" "$tmp/slogdp"; then
    ok "demo model sampled generate with dp 2, sampled by the backend, equals the host sampler on tp 3"
  else
    bad "sampled generate with dp 2: $(grep steps "$tmp/slogdp") / $(cat "$tmp/sdp.jsonl")"
  fi
  # dp 2: three prompts spread over both replicas; one prompt leaves replica 1 idle
  mpi 2 "$fl" generate --output-format compact --model "$demo" --input "$tmp/req.jsonl" --output "$tmp/dp.jsonl" --backend cpu \
    --dp 2 >"$tmp/log" 2>&1
  if [ $? -eq 0 ] && [ "$(sort "$tmp/one.jsonl")" = "$(sort "$tmp/dp.jsonl")" ] && [ -s "$tmp/one.jsonl" ]; then
    ok "demo model greedy generate with dp 2 equals 1 rank"
  else
    bad "demo generate with dp 2: $(cat "$tmp/log") / $(cat "$tmp/dp.jsonl")"
  fi
  head -1 "$tmp/req.jsonl" >"$tmp/req1.jsonl"
  mpi 2 "$fl" generate --output-format compact --model "$demo" --input "$tmp/req1.jsonl" --output "$tmp/dp1.jsonl" --backend cpu \
    --dp 2 >"$tmp/log" 2>&1
  if [ $? -eq 0 ] && [ "$(cat "$tmp/dp1.jsonl")" = "$(grep '"custom_id":"a"' "$tmp/one.jsonl")" ]; then
    ok "demo model greedy generate with dp 2, one prompt (replica 1 idles), equals 1 rank"
  else
    bad "demo generate with dp 2, one prompt: $(cat "$tmp/log") / $(cat "$tmp/dp1.jsonl")"
  fi
else
  bad "demo model missing at $demo"
fi

# Generation on several ranks for every golden architecture, and under dp:
# the golden fixtures (vocabularies >= 256) with
# a byte-level BPE tokenizer of 256 tokens and no merges, several prompts of
# different lengths (both replicas busy, finishing at different steps) and
# one prompt (the idle replica still serves its experts' share of the other
# replica's tokens).
mktok() { # tokenizer.json vocab_size: 256 byte tokens, the ids above them as added tokens
  python3 "$src/tests/make_byte_tokenizer.py" "$1" "$2"
}
cat >"$tmp/moe_req.jsonl" <<'JSONL'
{"custom_id": "a", "body": {"prompt": "Hello world, this is", "max_tokens": 10}}
{"custom_id": "b", "body": {"prompt": "abc", "max_tokens": 12}}
{"custom_id": "c", "body": {"prompt": "The quick brown fox jumps", "max_tokens": 7}}
{"custom_id": "d", "body": {"prompt": "zz", "max_tokens": 9}}
JSONL
head -1 "$tmp/moe_req.jsonl" >"$tmp/moe_req1.jsonl"
printf 'dp: 2\nep: 2\n' >"$tmp/dp2ep2.yaml"
# fixture : "np,tp,ep" layouts with dp = np / tp > 1
declare -A gen_layouts=([mixtral]="2,1,2 4,2,4" [deepseek_v2]="4,2,4" [qwen2_moe]="4,1,2"
  [llama]="4,2,1" [qwen2]="2,2,1" [llama_tied_rope3]="2,2,1" [qwen3_moe]="2,2,2"
  [deepseek_v2_lite]="2,2,2")
for fx in "${!gen_layouts[@]}"; do
  mdir=$tmp/$fx
  mkdir -p "$mdir"
  for f in config.json generation_config.json model.safetensors; do
    ln -sf "$(cd "$src/tests/golden/$fx" && pwd)/$f" "$mdir/$f"
  done
  mktok "$mdir/tokenizer.json" "$(python3 -c "import json; print(json.load(open('$mdir/config.json'))['vocab_size'])")"
  rm -f "$tmp/g1.jsonl" # generate resumes an existing output file
  "$fl" generate --output-format compact --model "$mdir" --input "$tmp/moe_req.jsonl" --output "$tmp/g1.jsonl" --backend cpu \
    >"$tmp/log" 2>&1 || { bad "$fx generate on one rank: $(cat "$tmp/log")"; continue; }
  for lay in ${gen_layouts[$fx]}; do
    IFS=, read -r np tp ep <<<"$lay"
    for req in moe_req moe_req1; do
      name="$fx generate np=$np tp=$tp dp=$((np / tp)) ep=$ep, $( [ $req = moe_req ] && echo "4 prompts" || echo "1 prompt")"
      rm -f "$tmp/gn.jsonl"
      if [ "$np,$tp,$ep" = "2,1,2" ]; then # the layout from a --config file (dp:, ep:)
        mpi "$np" "$fl" generate --output-format compact --model "$mdir" --input "$tmp/$req.jsonl" --output "$tmp/gn.jsonl" \
          --backend cpu --config "$tmp/dp2ep2.yaml" >"$tmp/log" 2>&1
      else
        mpi "$np" "$fl" generate --output-format compact --model "$mdir" --input "$tmp/$req.jsonl" --output "$tmp/gn.jsonl" \
          --backend cpu --tp "$tp" --ep "$ep" --dp $((np / tp)) >"$tmp/log" 2>&1
      fi
      rc=$?
      if [ $req = moe_req ]; then want=$(sort "$tmp/g1.jsonl"); else want=$(grep '"custom_id":"a"' "$tmp/g1.jsonl"); fi
      if [ $rc -eq 0 ] && [ -s "$tmp/gn.jsonl" ] && [ "$(sort "$tmp/gn.jsonl")" = "$want" ]; then
        ok "$name equals 1 rank"
      else
        bad "$name (rc=$rc): $(tail -3 "$tmp/log") / $(cat "$tmp/gn.jsonl" 2>/dev/null)"
      fi
    done
  done
done

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
