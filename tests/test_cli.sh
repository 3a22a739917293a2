#!/usr/bin/env bash
# test_cli.sh FLOTILLA SRC — the flotilla command as a user meets it: each
# subcommand's happy path, the demo model answering a question, and one clear
# stderr line with a non-zero exit for bad flags, missing files and
# unsupported models. Prints "N passed, M failed".
set -u
fl=$1
src=$2
demo=${FL_DEMO_GGUF:-$src/models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   - $1"; }
bad() { fail=$((fail + 1)); echo "FAIL - $1"; }
check() { # name, condition (a command)
  local name=$1
  shift
  if "$@"; then ok "$name"; else bad "$name"; fi
}
# expect_error NAME PATTERN -- CMD...: non-zero exit, exactly one stderr line matching PATTERN
expect_error() {
  local name=$1 pat=$2
  shift 3
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ $rc -ne 0 ] && [ "$(wc -l <"$tmp/err")" -eq 1 ] && grep -q -- "$pat" "$tmp/err"; then
    ok "$name"
  else
    bad "$name (rc=$rc, stderr: $(head -c 300 "$tmp/err"))"
  fi
}

llama=$src/tests/golden/llama
expect_error "unknown command" "unknown command" -- "$fl" frobnicate
expect_error "unknown flag" "unknown option '--bogus'" -- "$fl" inspect --model "$llama" --bogus
expect_error "missing model" "$tmp/nope" -- "$fl" inspect --model "$tmp/nope"
expect_error "bad number" "--temperature must be" -- "$fl" generate --output-format compact --model "$llama" --input x --output y --temperature hot
mkdir -p "$tmp/unsup"
printf '{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}' >"$tmp/unsup/config.json"
printf 'x' >"$tmp/unsup/model.safetensors"
expect_error "unsupported architecture" "GPT2LMHeadModel" -- "$fl" inspect --model "$tmp/unsup"

# --config: a flat YAML of options; flags override it; bad files name the line and key
printf 'model: %s\nbackend: cpu\n' "$llama" >"$tmp/c.yaml"
"$fl" inspect --config "$tmp/c.yaml" >"$tmp/inspect" 2>&1
check "config file" grep -q "LlamaForCausalLM" "$tmp/inspect"
"$fl" inspect --config "$tmp/c.yaml" --model "$src/tests/golden/qwen2" >"$tmp/inspect" 2>&1
check "flag overrides config" grep -q "Qwen2ForCausalLM" "$tmp/inspect"
printf 'model: x\nbogus_key: 3\n' >"$tmp/bad.yaml"
expect_error "config unknown key" "bad.yaml:2: unknown key 'bogus_key'" -- "$fl" inspect --config "$tmp/bad.yaml"
printf 'model: [a, b]\n' >"$tmp/bad2.yaml"
expect_error "config list value" "bad2.yaml:1: model takes one value" -- "$fl" inspect --config "$tmp/bad2.yaml"

"$fl" inspect --model "$llama" >"$tmp/inspect" 2>&1
check "inspect" grep -q "LlamaForCausalLM" "$tmp/inspect"

# logits: the file holds [T, vocab] float32. The ids are the first 5 of the
# golden prompt, so (causal attention) the rows must be the first 5 rows of
# the transformers float64 reference logits.f64 (tests/golden/README.md), to
# test_golden's 1e-4 of each row's largest |logit|.
python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['prompt_ids'][:5])" "$llama/golden.json" >"$tmp/ids.json"
"$fl" logits --model "$llama" --input-ids "$tmp/ids.json" --output "$tmp/l.f32" --backend cpu
check "logits size" test "$(stat -c %s "$tmp/l.f32")" -eq $((5 * 311 * 4))
cmp_golden() { # got.f32 ref.f64 rows vocab: worst per-row max|got - ref| / max|ref| <= 1e-4
  python3 - "$@" <<'PY'
import array, sys
got, ref = array.array("f"), array.array("d")
got.frombytes(open(sys.argv[1], "rb").read())
ref.frombytes(open(sys.argv[2], "rb").read())
T, V = int(sys.argv[3]), int(sys.argv[4])
worst = max(max(abs(got[t * V + v] - ref[t * V + v]) for v in range(V)) / max(abs(ref[t * V + v]) for v in range(V))
            for t in range(T))
print(f"logits vs logits.f64: worst row relative error {worst:.2e}")
sys.exit(0 if worst <= 1e-4 else 1)
PY
}
check "logits match the golden reference" cmp_golden "$tmp/l.f32" "$llama/logits.f64" 5 311
echo '[1, 2, 99999]' >"$tmp/badids.json"
expect_error "logits bad id" "outside the vocabulary" -- "$fl" logits --model "$llama" --input-ids "$tmp/badids.json" --output "$tmp/x.f32" --backend cpu

if [ -f "$demo" ]; then
  # tokenize / decode round trip through the GGUF's own tokenizer
  echo '["Hello world!", "The capital of France is Paris."]' >"$tmp/s.json"
  "$fl" tokenize --model "$demo" --input "$tmp/s.json" >"$tmp/ids2.json"
  "$fl" tokenize --model "$demo" --input "$tmp/ids2.json" --decode >"$tmp/back.json"
  check "tokenize round trip" python3 -c "import json,sys; a=json.load(open('$tmp/s.json')); b=json.load(open('$tmp/back.json')); sys.exit(a!=b)"

  # generate: a good request, a malformed line in the middle, a stop string
  cat >"$tmp/req.jsonl" <<'JSONL'
{"custom_id": "capital", "body": {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24}}
{"custom_id": "broken", "body": {"messages": [{"role": "user", "content": 42}]}}
not json at all
{"custom_id": "stop", "body": {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 30, "stop": [" 9"]}}
JSONL
  "$fl" generate --output-format compact --model "$demo" --input "$tmp/req.jsonl" --output "$tmp/res.jsonl" --backend cpu 2>"$tmp/gen.err"
  check "generate exit 0" test $? -eq 0
  check "four result lines" test "$(wc -l <"$tmp/res.jsonl")" -eq 4
  check "Paris" python3 - "$tmp/res.jsonl" <<'PY'
import json, sys
r = {x.get("custom_id"): x for x in map(json.loads, open(sys.argv[1]))}
assert "Paris" in r["capital"]["text"], r["capital"]
assert r["capital"]["finish_reason"] == "stop" and r["capital"]["completion_tokens"] > 0
PY
  check "error records" python3 - "$tmp/res.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
errs = [r for r in rows if "error" in r]
assert len(errs) == 2, errs
assert any(e["custom_id"] == "broken" and e["error"]["line"] == 2 and "content" in e["error"]["message"] for e in errs)
assert any(e["custom_id"] is None and e["error"]["line"] == 3 for e in errs)
PY
  check "stop string" python3 - "$tmp/res.jsonl" <<'PY'
import json, sys
r = {x.get("custom_id"): x for x in map(json.loads, open(sys.argv[1]))}["stop"]
assert r["finish_reason"] == "stop" and " 9" not in r["text"] and r["text"].strip().startswith("7"), r
PY
else
  bad "demo model missing at $demo (run scripts/fetch_demo_model.sh)"
fi

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
