#!/usr/bin/env bash
# test_quantize.sh FLOTILLA SRC — `flotilla quantize` on the `planted` fixture
# (tests/quantize/make_planted.py: a tiny float llama with planted
# large-activation channels):
#  - the AWQ checkpoint's logits are closer to the float model's than both
#    round-to-nearest at load (--quantize w4, same group 128) and the same
#    writer without the searches (--method rtn): the effect AWQ exists for;
#  - flotilla's logits on the written checkpoint equal those transformers
#    computed on it (hf_awq_logits.f32: tests/quantize/check_awq_hf.py, which
#    dequantizes the AutoAWQ GEMM packing independently in numpy);
#  - config.json carries AutoAWQ's quantization_config, tokenizer files are
#    copied, a progress line is printed per layer;
#  - bad input (MoE, MLA, already quantized, GGUF, a group that does not
#    divide, a JSONL line without text, an empty file, an unknown format) is
#    refused with a line naming it. Prints "N passed, M failed".
set -u
fl=$1
src=$2
. "$src/tests/lib.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fx=$src/tests/quantize/planted
ids=$fx/eval_ids.json

if "$fl" quantize --model "$fx" --calib "$fx/calib.txt" --output "$tmp/awq" --n-samples 4 --seq-len 128 \
     2>"$tmp/awq.err"; then
  ok "quantize (awq): $(grep -c '^flotilla quantize: layer' "$tmp/awq.err") progress lines"
else
  bad "quantize (awq): $(tail -2 "$tmp/awq.err")"
fi
[ "$(grep -c '^flotilla quantize: layer [12]/2 qkv alpha' "$tmp/awq.err")" = 2 ] && ok "one progress line per layer" ||
  bad "progress lines: $(cat "$tmp/awq.err")"
"$fl" quantize --model "$fx" --calib "$fx/calib.txt" --output "$tmp/rtn" --method rtn --n-samples 4 --seq-len 128 \
  2>"$tmp/rtn.err" || bad "quantize (rtn): $(tail -2 "$tmp/rtn.err")"

run_logits() { # NAME ARGS...: logits of the eval prompt into $tmp/NAME.f32
  local name=$1
  shift
  "$fl" logits "$@" --backend cpu --input-ids "$ids" --output "$tmp/$name.f32" 2>"$tmp/$name.lerr" ||
    bad "logits $name: $(tail -2 "$tmp/$name.lerr")"
}
run_logits float --model "$fx"
run_logits rtn_load --model "$fx" --quantize w4
run_logits rtn --model "$tmp/rtn"
run_logits awq --model "$tmp/awq"

# relative L2 error of each quantized model's logits against the float model's
if msg=$(python3 - "$tmp" <<'PY'
import array, sys
def rd(p):
    a = array.array("f")
    a.frombytes(open(p, "rb").read())
    return a
f = rd(sys.argv[1] + "/float.f32")
den = sum(x * x for x in f)
e = {m: (sum((x - y) ** 2 for x, y in zip(f, rd(f"{sys.argv[1]}/{m}.f32"))) / den) ** 0.5
     for m in ("rtn_load", "rtn", "awq")}
print(f"logit rel err: --quantize w4 {e['rtn_load']:.4f}, --method rtn {e['rtn']:.4f}, awq {e['awq']:.4f}")
sys.exit(0 if e["awq"] < 0.8 * e["rtn"] and e["awq"] < 0.8 * e["rtn_load"] else 1)
PY
); then ok "AWQ beats RTN: $msg"; else bad "AWQ does not beat RTN: $msg"; fi

if msg=$(python3 - "$tmp/awq.f32" "$fx/hf_awq_logits.f32" <<'PY'
import array, sys
def rd(p):
    a = array.array("f")
    a.frombytes(open(p, "rb").read())
    return a
got, ref = rd(sys.argv[1]), rd(sys.argv[2])
V = 256
worst = max(max(abs(g - r) for g, r in zip(got[i:i + V], ref[i:i + V])) / max(abs(r) for r in ref[i:i + V])
            for i in range(0, len(ref), V))
print(f"flotilla vs transformers on the written checkpoint: max rel err {worst:.2e}")
sys.exit(0 if len(got) == len(ref) and worst <= 1e-4 else 1)
PY
); then ok "$msg"; else bad "transformers logits: $msg"; fi

if python3 - "$tmp/awq/config.json" <<'PY'
import json, sys
q = json.load(open(sys.argv[1]))["quantization_config"]
sys.exit(0 if q == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                    "modules_to_not_convert": None} else 1)
PY
then ok "config.json quantization_config"; else bad "config.json: $(cat "$tmp/awq/config.json")"; fi
cmp -s "$fx/tokenizer.json" "$tmp/awq/tokenizer.json" && ok "tokenizer.json copied" || bad "tokenizer.json not copied"

# JSONL calibration with "prompt" and "text" keys
printf '{"prompt": "The scale of the group."}\n\n{"text": "An output channel was large."}\n' >"$tmp/c.jsonl"
"$fl" quantize --model "$fx" --calib "$tmp/c.jsonl" --output "$tmp/j" --n-samples 2 --seq-len 16 2>"$tmp/j.err" &&
  run_logits j --model "$tmp/j" && ok "JSONL calibration" || bad "JSONL calibration: $(tail -2 "$tmp/j.err")"

refused() { # WHAT EXPECTED_SUBSTRING ARGS...
  local what=$1 want=$2
  shift 2
  if "$fl" quantize "$@" 2>"$tmp/r.err"; then
    bad "$what: accepted"
  elif grep -qF -- "$want" "$tmp/r.err"; then
    ok "$what refused: $(head -1 "$tmp/r.err")"
  else
    bad "$what: '$(head -1 "$tmp/r.err")' does not say '$want'"
  fi
}
g=$src/tests/golden
printf '{"text": "fine"}\n{"txt": "no"}\n' >"$tmp/bad.jsonl"
: >"$tmp/empty.txt"
refused "MoE" "Mixture-of-Experts" --model "$g/mixtral" --calib "$fx/calib.txt" --output "$tmp/x"
refused "MLA" "Mixture-of-Experts / MLA" --model "$g/deepseek_v2_lite" --calib "$fx/calib.txt" --output "$tmp/x"
refused "AWQ input" "already quantized" --model "$g/llama_awq" --calib "$fx/calib.txt" --output "$tmp/x"
refused "GGUF input" "not gguf files" --model "$src/tests/gguf/$(ls "$src/tests/gguf" | grep -m1 '\.gguf$')" \
  --calib "$fx/calib.txt" --output "$tmp/x"
refused "group 48" "--group-size must be 32, 64 or 128, got 48" --model "$fx" --calib "$fx/calib.txt" \
  --output "$tmp/x" --group-size 48
refused "group not dividing" "hidden_size = 48 is not a multiple of --group-size 32 (no group size of 32, 64 or 128 fits" \
  --model "$g/qwen2" --calib "$fx/calib.txt" --output "$tmp/x" --group-size 32
refused "JSONL line" "bad.jsonl:2: expected a JSON object" --model "$fx" --calib "$tmp/bad.jsonl" --output "$tmp/x"
refused "empty calibration" "empty.txt: the calibration file is empty" --model "$fx" --calib "$tmp/empty.txt" \
  --output "$tmp/x"
refused "compressed-tensors" "--format compressed-tensors" --model "$fx" --calib "$fx/calib.txt" --output "$tmp/x" \
  --format compressed-tensors
refused "missing --calib" "--calib" --model "$fx" --output "$tmp/x"
finish
