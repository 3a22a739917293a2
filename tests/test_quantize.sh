#!/usr/bin/env bash
# test_quantize.sh FLOTILLA SRC — `flotilla quantize` on the `planted` fixture
# (tests/quantize/make_planted.py: a tiny float llama with planted
# large-activation channels):
#  - the AWQ checkpoint's logits are closer to the float model's than both
#    round-to-nearest at load (--quantize w4, same group 128) and the same
#    writer without the searches (--method rtn): the effect AWQ exists for;
#  - flotilla's logits on the written checkpoint equal those transformers
#    computed on it, to 1e-5 with the plain C kernels (hf_awq_logits.f32:
#    tests/quantize/check_awq_hf.py, which dequantizes the AutoAWQ GEMM
#    packing independently in numpy);
#  - --format compressed-tensors: flotilla loads it, its logits equal those
#    transformers computed on it through the compressed-tensors package
#    (hf_ct_logits.f32: tests/quantize/check_ct_hf.py), the two formats decode
#    to the same weights (tests/quantize/same_weights.py, numpy) and flotilla's
#    logits on both are the same bits;
#  - config.json carries each format's quantization_config, tokenizer files
#    are copied, a progress line is printed per layer;
#  - resuming: a run killed after a layer (FL_TEST_QUANTIZE_KILL) and rerun
#    continues after its last finished layer and writes the same bytes as an
#    uninterrupted run; other options, a damaged state, a missing
#    model.safetensors and a folder another run holds are refused;
#  - bad input (MoE, MLA, already quantized, GGUF, a group that does not
#    divide, a JSONL line without text, an empty file, an unknown format) is
#    refused with a line naming it; --backend cuda in one process quantizes
#    on a GPU or says why it cannot;
#  - under mpirun (2 and 3 ranks, 7 samples split unevenly): the same bytes
#    as one rank; a run killed on 1 rank continues on 2, one killed on 2
#    (whose state file is the one-rank state) continues on 3, both to the
#    uninterrupted bytes; a rank failing alone (rank 0: a locked folder;
#    rank 1: a tensor missing in layer 2), input every rank refuses, ranks
#    given other options or backends and more ranks than samples end the job with a
#    non-zero status, the message printed once. Prints "N passed, M failed".
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
q_ct() { # OUT [ARGS...]: the awq run's command with --format compressed-tensors
  local out=$1
  shift
  "$fl" quantize --model "$fx" --calib "$fx/calib.txt" --output "$out" --n-samples 4 --seq-len 128 \
    --format compressed-tensors "$@"
}
q_ct "$tmp/ct" 2>"$tmp/ct.err" && ok "quantize (compressed-tensors)" || bad "quantize (ct): $(tail -2 "$tmp/ct.err")"

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
run_logits ct --model "$tmp/ct"
# against transformers, the plain C kernels: the AVX2 ones round activations to int16 blocks (about 1e-4)
FL_CPU_KERNELS=c run_logits awq_c --model "$tmp/awq"
FL_CPU_KERNELS=c run_logits ct_c --model "$tmp/ct"

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

close_to() { # FLOTILLA.f32 REFERENCE.f32: max |diff| / max |ref| per position <= 1e-5
  python3 - "$1" "$2" <<'PY'
import array, sys
def rd(p):
    a = array.array("f")
    a.frombytes(open(p, "rb").read())
    return a
got, ref = rd(sys.argv[1]), rd(sys.argv[2])
V = 256
worst = max(max(abs(g - r) for g, r in zip(got[i:i + V], ref[i:i + V])) / max(abs(r) for r in ref[i:i + V])
            for i in range(0, len(ref), V))
print(f"max rel err {worst:.2e}")
sys.exit(0 if len(got) == len(ref) and worst <= 1e-5 else 1)
PY
}
if msg=$(close_to "$tmp/awq_c.f32" "$fx/hf_awq_logits.f32"); then
  ok "flotilla vs transformers on the written AWQ checkpoint: $msg"
else bad "transformers logits (awq): $msg"; fi
if msg=$(close_to "$tmp/ct_c.f32" "$fx/hf_ct_logits.f32"); then
  ok "flotilla vs transformers + compressed-tensors on the written checkpoint: $msg"
else bad "transformers logits (compressed-tensors): $msg"; fi
cmp -s "$tmp/awq.f32" "$tmp/ct.f32" && cmp -s "$tmp/awq_c.f32" "$tmp/ct_c.f32" &&
  ok "flotilla's logits on both formats are the same bits" ||
  bad "flotilla's logits differ between the formats"
if msg=$(python3 "$src/tests/quantize/same_weights.py" "$tmp/awq" "$tmp/ct" 2>&1); then ok "$msg"
else bad "the formats decode differently: $msg"; fi

if python3 - "$tmp/awq/config.json" <<'PY'
import json, sys
q = json.load(open(sys.argv[1]))["quantization_config"]
sys.exit(0 if q == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                    "modules_to_not_convert": None} else 1)
PY
then ok "config.json quantization_config"; else bad "config.json: $(cat "$tmp/awq/config.json")"; fi
if python3 - "$tmp/ct/config.json" <<'PY'
import json, sys
q = json.load(open(sys.argv[1]))["quantization_config"]
w = {"num_bits": 4, "type": "int", "symmetric": False, "group_size": 128, "strategy": "group", "dynamic": False}
g = {"targets": ["Linear"], "weights": w, "input_activations": None, "output_activations": None,
     "format": "pack-quantized"}
sys.exit(0 if q == {"config_groups": {"group_0": g}, "quant_method": "compressed-tensors", "format": "pack-quantized",
                    "quantization_status": "compressed", "global_compression_ratio": None, "ignore": ["lm_head"],
                    "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}} else 1)
PY
then ok "config.json quantization_config (compressed-tensors)"; else bad "ct config.json: $(cat "$tmp/ct/config.json")"; fi
cmp -s "$fx/tokenizer.json" "$tmp/awq/tokenizer.json" && ok "tokenizer.json copied" || bad "tokenizer.json not copied"

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

# resuming: killed once layer 2's tensors are written (layer 1 recorded as finished), then rerun
if FL_TEST_QUANTIZE_KILL=2 q_ct "$tmp/res" 2>"$tmp/res1.err"; then bad "FL_TEST_QUANTIZE_KILL=2: not killed"
elif grep -q 'layer 2/2' "$tmp/res1.err" || ! grep -q 'layer 1/2' "$tmp/res1.err" ||
  [ ! -f "$tmp/res/.flotilla-quantize.state" ]; then bad "killed run: $(cat "$tmp/res1.err")"
else ok "run killed after layer 1/2 finished and layer 2 written"; fi
cp -r "$tmp/res" "$tmp/res5" # killed runs for the refusal checks below
cp -r "$tmp/res" "$tmp/res3"
: >"$tmp/res/.flotilla-quantize.state.tmp.99999" # as a kill while the state was being replaced leaves
if q_ct "$tmp/res" 2>"$tmp/res2.err" && grep -q 'continuing the unfinished run in .* after layer 1/2' "$tmp/res2.err" &&
  [ "$(grep -c '^flotilla quantize: layer' "$tmp/res2.err")" = 1 ]; then ok "rerun continued after layer 1/2"
else bad "rerun: $(cat "$tmp/res2.err")"; fi
cmp -s "$tmp/res/model.safetensors" "$tmp/ct/model.safetensors" && cmp -s "$tmp/res/config.json" "$tmp/ct/config.json" &&
  ok "resumed output is byte for byte the uninterrupted one" || bad "resumed output differs from the uninterrupted one"
[ -z "$(ls -A "$tmp/res" | grep flotilla-quantize)" ] && ok "state files removed when done" ||
  bad "state files left: $(ls -A "$tmp/res")"
# an unfinished run: other options are refused, and a damaged state too
if q_ct "$tmp/res3" --group-size 64 2>"$tmp/r.err"; then bad "resume with another group size: accepted"
elif grep -qF "holds an unfinished quantization by other settings (that run's vs this one's: option group-size: 128 vs 64" \
  "$tmp/r.err"; then ok "resume with other options refused: $(head -1 "$tmp/r.err")"
else bad "resume with other options: $(cat "$tmp/r.err")"; fi
head -c 100 "$tmp/res/model.safetensors" >"$tmp/res3/.flotilla-quantize.state" # a damaged state
if q_ct "$tmp/res3" 2>"$tmp/r.err"; then bad "damaged state: accepted"
elif grep -qF "is not a flotilla quantize state file" "$tmp/r.err"; then ok "damaged state refused: $(head -1 "$tmp/r.err")"
else bad "damaged state: $(cat "$tmp/r.err")"; fi
rm "$tmp/res5/model.safetensors"
refused "resume without model.safetensors" "cannot continue the unfinished run in $tmp/res5 (cannot open $tmp/res5/model.safetensors" \
  --model "$fx" --calib "$fx/calib.txt" --output "$tmp/res5" --n-samples 4 --seq-len 128 --format compressed-tensors
mkdir "$tmp/lk" # a folder another run holds
if flock "$tmp/lk" "$fl" quantize --model "$fx" --calib "$fx/calib.txt" --output "$tmp/lk" 2>"$tmp/r.err"; then
  bad "a locked output folder: accepted"
elif grep -qF "is in use by another flotilla quantize run (locked)" "$tmp/r.err"; then ok "locked output folder refused"
else bad "locked output folder: $(cat "$tmp/r.err")"; fi
FL_TEST_QUANTIZE_KILL=2 "$fl" quantize --model "$fx" --calib "$fx/calib.txt" --output "$tmp/res4" --n-samples 4 \
  --seq-len 128 2>/dev/null
"$fl" quantize --model "$fx" --calib "$fx/calib.txt" --output "$tmp/res4" --n-samples 4 --seq-len 128 2>"$tmp/r.err" &&
  cmp -s "$tmp/res4/model.safetensors" "$tmp/awq/model.safetensors" && ok "AWQ format resumed to the same bytes" ||
  bad "AWQ resume: $(tail -2 "$tmp/r.err")"

# JSONL calibration with "prompt" and "text" keys
printf '{"prompt": "The scale of the group."}\n\n{"text": "An output channel was large."}\n' >"$tmp/c.jsonl"
"$fl" quantize --model "$fx" --calib "$tmp/c.jsonl" --output "$tmp/j" --n-samples 2 --seq-len 16 2>"$tmp/j.err" &&
  run_logits j --model "$tmp/j" && ok "JSONL calibration" || bad "JSONL calibration: $(tail -2 "$tmp/j.err")"

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
refused "unknown format" "--format must be awq or compressed-tensors, got 'gptq'" --model "$fx" --calib "$fx/calib.txt" \
  --output "$tmp/x" --format gptq
refused "missing --calib" "--calib" --model "$fx" --output "$tmp/x"
# --backend cuda in one process (MPI not started): quantizes on the GPU, or
# says why it cannot, never an MPI abort
if "$fl" quantize --model "$fx" --calib "$fx/calib.txt" --output "$tmp/gpu1" --backend cuda 2>"$tmp/r.err"; then
  ok "--backend cuda: quantized on a GPU"
elif grep -qi "cuda backend" "$tmp/r.err" && ! grep -q "MPI" "$tmp/r.err"; then
  ok "--backend cuda without a GPU refused: $(head -1 "$tmp/r.err")"
else bad "--backend cuda in one process: $(head -3 "$tmp/r.err")"; fi
# several ranks (mpirun as tests/test_mpi_golden.sh starts it): the samples are split over the ranks and the
# checkpoint is the one-rank run's, byte for byte. 400 tokens: 5 samples of 80, which 2 and 3 ranks split
# unevenly, with the clipping search sampling at most 128 tokens (FL_TEST_QUANTIZE_CLIP_TOKENS; 512 by default),
# so it picks every 3rd token across the ranks.
fl_mpi_env
export FL_TEST_QUANTIZE_CLIP_TOKENS=128
mpi() { timeout 120 mpirun --oversubscribe --bind-to none -np "$1" -x FL_TEST_QUANTIZE_CLIP_TOKENS "${@:2}"; }
if ! command -v mpirun >/dev/null; then bad "mpirun not found: the multi-rank checks cannot run"; fi
head -c 400 "$fx/calib.txt" >"$tmp/c400.txt"
qm() { # OUT [LAUNCHER...]: one quantize run over c400.txt
  local out=$1
  shift
  "$@" "$fl" quantize --model "$fx" --calib "$tmp/c400.txt" --output "$out" --n-samples 64 --seq-len 80
}
# the one-rank reference, killed after layer 1 and continued (resuming on one rank writes the uninterrupted
# bytes: checked above; the 2-rank run below, uninterrupted, must equal it too)
FL_TEST_QUANTIZE_KILL=2 qm "$tmp/m1" 2>/dev/null
cp "$tmp/m1/.flotilla-quantize.state" "$tmp/state1"
cp -r "$tmp/m1" "$tmp/mr2"
qm "$tmp/m1" 2>"$tmp/m1.err" || bad "one rank: $(tail -2 "$tmp/m1.err")"
grep -q '400 calibration tokens in 5 samples' "$tmp/m1.err" || bad "c400.txt: $(head -1 "$tmp/m1.err")"
if qm "$tmp/m2" mpi 2 2>"$tmp/m2.err" && grep -q "samples split over 2 ranks" "$tmp/m2.err" &&
  [ "$(grep -c '^flotilla quantize: layer' "$tmp/m2.err")" = 2 ] &&
  [ "$(grep -c '^flotilla quantize: wrote' "$tmp/m2.err")" = 1 ]; then
  cmp -s "$tmp/m2/model.safetensors" "$tmp/m1/model.safetensors" && cmp -s "$tmp/m2/config.json" "$tmp/m1/config.json" &&
    ok "mpirun -np 2 (5 samples split unevenly): byte for byte the one-rank checkpoint" ||
    bad "mpirun -np 2: the checkpoint differs from the one-rank run's"
else bad "mpirun -np 2: $(cat "$tmp/m2.err")"; fi
# resuming across rank counts: killed on one rank and continued on 2; killed on 2 and continued on 3
if qm "$tmp/mr2" mpi 2 2>"$tmp/r.err" && grep -q 'continuing the unfinished run in .* after layer 1/2' "$tmp/r.err" &&
  cmp -s "$tmp/mr2/model.safetensors" "$tmp/m1/model.safetensors"; then
  ok "killed on one rank after layer 1, continued on 2: the uninterrupted bytes"
else bad "resume on 2 ranks: $(tail -3 "$tmp/r.err")"; fi
if FL_TEST_QUANTIZE_KILL=2 qm "$tmp/mr3" mpi 2 -x FL_TEST_QUANTIZE_KILL >/dev/null 2>&1; then
  bad "FL_TEST_QUANTIZE_KILL=2 at np 2: not killed"
else
  cmp -s "$tmp/mr3/.flotilla-quantize.state" "$tmp/state1" &&
    ok "the state 2 ranks leave is the one-rank state (every rank's hidden states, gathered)" ||
    bad "the 2-rank state file differs from the one-rank one"
fi
if qm "$tmp/mr3" mpi 3 2>"$tmp/r.err" && grep -q 'continuing the unfinished run in .* after layer 1/2' "$tmp/r.err" &&
  grep -q "samples split over 3 ranks" "$tmp/r.err" && cmp -s "$tmp/mr3/model.safetensors" "$tmp/m1/model.safetensors" &&
  cmp -s "$tmp/mr3/config.json" "$tmp/m1/config.json"; then
  ok "killed on 2 ranks after layer 1, continued on 3 (5 samples split unevenly): the uninterrupted bytes"
else bad "resume on 3 ranks: $(tail -3 "$tmp/r.err")"; fi

# a failing rank ends the job: exit status non-zero, no hang (timeout), its message printed once
mpi_refused() { # WHAT EXPECTED_LINE COMMAND...
  local what=$1 want=$2
  shift 2
  "$@" >"$tmp/r.err" 2>&1
  local rc=$? n
  n=$(grep -cF -- "$want" "$tmp/r.err")
  if [ "$rc" = 0 ] || [ "$rc" = 124 ] || [ "$n" != 1 ]; then
    bad "$what: exit $rc, '$want' printed $n times: $(head -5 "$tmp/r.err")"
  else ok "$what: exit $rc, printed once: $(grep -F -- "$want" "$tmp/r.err")"; fi
}
A=(--calib "$tmp/c400.txt" --n-samples 64 --seq-len 80)
mkdir "$tmp/lk2"
mpi_refused "rank 0 alone fails (its output folder is locked)" \
  "flotilla: rank 0: flotilla quantize: $tmp/lk2 is in use by another flotilla quantize run (locked)" \
  flock "$tmp/lk2" timeout 60 mpirun --oversubscribe --bind-to none -np 2 "$fl" quantize --model "$fx" "${A[@]}" \
  --output "$tmp/lk2"
mkdir "$tmp/cut" # the planted model without layer 2's tensors, for rank 1 alone
cp "$fx/config.json" "$fx/tokenizer.json" "$tmp/cut/"
python3 - "$fx/model.safetensors" "$tmp/cut/model.safetensors" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
head, data, out, blobs, off = json.loads(b[8:8 + n]), b[8 + n:], {}, [], 0
for k, v in head.items():
    if k == "__metadata__" or k.startswith("model.layers.1."):
        continue
    s, e = v["data_offsets"]
    out[k] = dict(v, data_offsets=[off, off + e - s])
    blobs.append(data[s:e])
    off += e - s
h = json.dumps(out).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
PY
mpi_refused "rank 1 of 2 fails in layer 2" \
  "flotilla: rank 1: flotilla quantize: tensor \"model.layers.1.input_layernorm.weight\" not found in checkpoint" \
  mpi 1 "$fl" quantize --model "$fx" "${A[@]}" --output "$tmp/f1" : -np 1 "$fl" quantize --model "$tmp/cut" \
  "${A[@]}" --output "$tmp/f1"
mpi_refused "a bad calibration file on every rank" "flotilla quantize: $tmp/bad.jsonl:2: expected a JSON object" \
  mpi 2 "$fl" quantize --model "$fx" --calib "$tmp/bad.jsonl" --output "$tmp/f2"
mpi_refused "ranks with other options" "flotilla quantize: the ranks disagree on the calibration tokens or the options" \
  mpi 1 "$fl" quantize --model "$fx" "${A[@]}" --output "$tmp/f3" : -np 1 "$fl" quantize --model "$fx" \
  --calib "$tmp/c400.txt" --n-samples 64 --seq-len 70 --output "$tmp/f3"
mpi_refused "more ranks than samples" "flotilla quantize: 3 ranks but 2 calibration sample(s)" \
  mpi 3 "$fl" quantize --model "$fx" --calib "$tmp/c400.txt" --output "$tmp/f4" --n-samples 2 --seq-len 16
mpi_refused "ranks on other backends" \
  "flotilla quantize: --backend must be the same on every rank (some have cpu, some cuda)" \
  mpi 1 "$fl" quantize --model "$fx" "${A[@]}" --output "$tmp/f5" : -np 1 "$fl" quantize --model "$fx" "${A[@]}" \
  --output "$tmp/f5" --backend cuda
finish
