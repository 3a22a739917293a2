#!/usr/bin/env bash
# test_bench_cpu.sh — `flotilla bench --model` on the CPU backend: the demo
# GGUF and a safetensors fixture, a few steps each; the JSON's decode and
# prefill speeds, the bytes a decode step reads (worked out from the files),
# the fractions of the bandwidth measured in the same run, the batch-1 pass,
# and the flag errors. Usage: test_bench_cpu.sh FLOTILLA SOURCE_DIR
set -u
fl=$1
src=$2
. "$src/tests/lib.sh"
fl_require_demo "$src"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
export OMP_NUM_THREADS=2

# check FILE EXPR: a Python expression over the JSON as j
check() { python3 -c "import json,sys; j=json.load(open(sys.argv[1])); sys.exit(0 if ($2) else 1)" "$1"; }

# The demo model (SmolLM2-135M Q4_1, lm_head Q8_0): 30 layers of 3,538,944
# linear weights at 0.75 bytes (Q4_1 -> W4 group 32: half a byte plus an f32
# scale and bias per 32) = 79,626,240, their two f32 norms 138,240, lm_head
# 49152 x 576 Q8_0 (34 bytes per 32) 30,081,024 and the final norm 2,304:
# 109,847,808 bytes a step. 110 MB is far over any cache, so the decode's
# bandwidth is DRAM's and its fraction of the ceiling lies in (0, 1.5].
if "$fl" bench --model "$demo" --backend cpu --threads 2 --batch 2 --prompt-len 8 --gen-len 4 \
     --output "$T/demo.json" >"$T/demo.out" 2>&1 &&
   check "$T/demo.json" "j['model'].endswith('.gguf') and j['preset'] is None and j['decode_steps']==3 and j['decode_tok_s']>0 and j['prefill_tok_s']>0 and j['prefill_tokens']==16 and j['prefill_GFLOPs']>0 and j['weight_bytes_per_step']==109847808 and j['kv_bytes_per_step']>0 and 0<j['fraction_of_ceiling']<=1.5 and 0<j['fraction_of_read_ceiling']<=1.5 and j['copy_ceiling_threads']==2 and j['threads']==2 and j['read_ceiling_GBps']>0"; then
  ok "demo GGUF: decode and prefill tok/s, bytes per step, fractions of the ceilings"
else
  bad "demo GGUF"; cat "$T/demo.out"; head -c 1500 "$T/demo.json"
fi
if check "$T/demo.json" "j['batch1']['decode_tok_s']>0 and j['batch1']['prefill_tok_s']>0 and 0<j['batch1']['fraction_of_ceiling']<=1.5 and 0<j['batch1']['fraction_of_read_ceiling']<=1.5" &&
   grep -q "read ceiling" "$T/demo.out" && grep -q "batch 1:" "$T/demo.out"; then
  ok "demo GGUF: the batch-1 pass next to batch 2, printed and in the JSON"
else
  bad "demo GGUF batch 1"; cat "$T/demo.out"
fi

# A safetensors folder (f32 weights as stored): a step reads every tensor of
# the file but the embedding, byte for byte. The fixture fits in the caches,
# so its fraction of the DRAM ceiling has no upper bound worth asserting.
want=$(python3 - "$src/tests/golden/llama/model.safetensors" <<'EOF'
import json, struct, sys
f = open(sys.argv[1], "rb")
h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
print(sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items()
          if k != "__metadata__" and "embed_tokens" not in k))
EOF
)
if "$fl" bench --model "$src/tests/golden/llama" --backend cpu --batch 3 --prompt-len 5 --gen-len 3 \
     --output "$T/st.json" >"$T/st.out" 2>&1 &&
   check "$T/st.json" "j['weight_bytes_per_step']==$want and j['decode_steps']==2 and j['decode_tok_s']>0 and j['prefill_tok_s']>0 and j['fraction_of_ceiling']>0 and j['batch1']['decode_tok_s']>0 and j['quantize']=='as stored'"; then
  ok "safetensors: bytes per step = the file's tensors but the embedding ($want)"
else
  bad "safetensors"; cat "$T/st.out"; head -c 1500 "$T/st.json"
fi
# batch 1 asked for: no second pass
if "$fl" bench --model "$src/tests/golden/llama" --backend cpu --prompt-len 4 --gen-len 3 --output "$T/b1.json" \
     >"$T/b1.out" 2>&1 && check "$T/b1.json" "'batch1' not in j and j['batch']==1"; then
  ok "--batch 1: one pass"
else
  bad "--batch 1"; cat "$T/b1.out"
fi
# the fixed batch's cache in bf16: half the KV bytes a step of the f32 one
if "$fl" bench --model "$src/tests/golden/llama" --backend cpu --prompt-len 4 --gen-len 3 --kv-cache-dtype bf16 \
     --output "$T/b1h.json" >"$T/b1h.out" 2>&1 && check "$T/b1.json" "j['kv_cache_dtype']=='f32'" &&
   python3 -c "import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); sys.exit(0 if b['kv_cache_dtype']=='bf16' and 2*b['kv_bytes_per_step']==a['kv_bytes_per_step']>0 and b['decode_tok_s']>0 else 1)" "$T/b1.json" "$T/b1h.json"; then
  ok "--kv-cache-dtype bf16: a 16-bit cache, half the KV bytes a step"
else
  bad "--kv-cache-dtype bf16"; cat "$T/b1h.out"
fi

# errors: one clear line each
expect_err() { # expect_err PATTERN ARGS...: fails, and says PATTERN
  local pat=$1
  shift
  if ! "$fl" bench "$@" >"$T/err.out" 2>&1 && grep -q -- "$pat" "$T/err.out"; then
    ok "error: $pat"
  else
    bad "error: $pat"; cat "$T/err.out"
  fi
}
expect_err "give one of --preset NAME and --model PATH" --preset tiny --model "$demo" --backend cpu
expect_err "give one of --preset NAME and --model PATH" --backend cpu
expect_err "--layers applies to --preset only" --model "$demo" --layers 2 --backend cpu
expect_err "$T/none.gguf" --model "$T/none.gguf" --backend cpu
finish
