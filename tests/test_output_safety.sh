#!/usr/bin/env bash
# test_output_safety.sh FLOTILLA SRC — `flotilla generate` never loses or
# changes a file that is not its own, and refuses what it cannot use:
# - --output on a one-line JSON settings file, a one-line note, a multi-line
#   foreign file, the input itself (same path, symlink, hard link), a device
#   (/dev/full), a FIFO, a results file of another job (other options, a
#   changed input), a user's file at the state-file path: refused, every
#   byte unchanged;
# - a results file without a state file: refused, adopted with --resume;
#   --overwrite of a foreign file refused; --output - writes to stdout;
# - an escaped NUL (\u0000) in a prompt, a message or a stop string: an
#   error record naming the field (and in `tokenize`, the element);
# - loaded metadata checked: a GGUF eos id outside the vocabulary and a
#   config.json with more layers than tensors refused by inspect/generate;
#   experts stored fused (mlp.experts.gate_up_proj) refused by name;
# - the progress line counts the tokens of a request still decoding; the
#   summary says n/a (not nan) when nothing ran; a missing flag is named;
#   inspect --help lists no engine option; generate --help documents the
#   output files and the second signal.
# Prints "N passed, M failed".
set -u
fl=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. "$src/tests/lib.sh"
fl_require_demo "$src"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
gen() { timeout 300 "$fl" generate --output-format compact --model "$demo" --backend cpu "$@"; }

python3 - >"$tmp/req.jsonl" <<'PY'
import json
for i in range(3):
    print(json.dumps({"custom_id": f"r{i}", "body": {"prompt": f"Item {i}: the", "max_tokens": 2}}))
PY

# refused PATTERN FILE -- ARGS...: generate exits non-zero with one stderr
# line matching PATTERN, FILE's bytes unchanged
refused() {
  local name=$1 pat=$2 file=$3
  shift 4
  local before=none after=none
  [ -e "$file" ] && before=$(cat "$file" | sha256sum)
  timeout 60 "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  [ -e "$file" ] && after=$(cat "$file" | sha256sum)
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$(wc -l <"$tmp/err")" -eq 1 ] && grep -q -- "$pat" "$tmp/err" &&
     [ "$before" = "$after" ]; then
    ok "$name: $(head -c 160 "$tmp/err")"
  else
    bad "$name (rc=$rc, unchanged: $([ "$before" = "$after" ] && echo yes || echo NO)): $(head -c 300 "$tmp/err")"
  fi
}
G=("$fl" generate --output-format compact --model "$demo" --backend cpu --input "$tmp/req.jsonl")

# ---- foreign files are never truncated or appended to
printf '{"learning_rate": 0.001, "epochs": 3}\n' >"$tmp/settings.json"
refused "one-line JSON settings file" "settings.json exists and was not written by this job" "$tmp/settings.json" -- \
  "${G[@]}" --output "$tmp/settings.json"
printf 'remember to buy milk' >"$tmp/note.txt"
refused "one-line note without newline" "note.txt exists" "$tmp/note.txt" -- "${G[@]}" --output "$tmp/note.txt"
refused "one-line note with --resume" "note.txt exists and was not written by this job" "$tmp/note.txt" -- \
  "${G[@]}" --output "$tmp/note.txt" --resume
printf 'line one\nline two\nline three\n' >"$tmp/notes.txt"
refused "multi-line foreign file" "notes.txt exists" "$tmp/notes.txt" -- "${G[@]}" --output "$tmp/notes.txt"
refused "--overwrite of a foreign file" "refusing to truncate" "$tmp/notes.txt" -- \
  "${G[@]}" --output "$tmp/notes.txt" --overwrite

# ---- the input itself, however it is named
refused "output = input" "is the input file" "$tmp/req.jsonl" -- "${G[@]}" --output "$tmp/req.jsonl"
refused "output = input with --resume" "is the input file" "$tmp/req.jsonl" -- "${G[@]}" --output "$tmp/req.jsonl" --resume
ln -s "$tmp/req.jsonl" "$tmp/link.jsonl"
refused "output = input through a symlink" "is the input file" "$tmp/req.jsonl" -- "${G[@]}" --output "$tmp/link.jsonl"
ln "$tmp/req.jsonl" "$tmp/hard.jsonl"
refused "output = input through a hard link" "is the input file" "$tmp/req.jsonl" -- "${G[@]}" --output "$tmp/hard.jsonl" --resume
[ ! -e "$tmp/req.jsonl.flotilla.json" ] && [ ! -e "$tmp/hard.jsonl.flotilla.json" ] && ok "no state file left beside the input" ||
  bad "a state file was written beside the input"

# ---- devices and pipes: refused at once (no endless read, no memory growth)
start=$(date +%s)
refused "--output /dev/full" "not a regular file" /dev/null -- "${G[@]}" --output /dev/full
refused "--output /dev/zero --resume" "not a regular file" /dev/null -- "${G[@]}" --output /dev/zero --resume
mkfifo "$tmp/fifo"
refused "--output a FIFO" "not a regular file" /dev/null -- "${G[@]}" --output "$tmp/fifo"
[ $(($(date +%s) - start)) -lt 60 ] && ok "devices refused quickly" || bad "devices took $(($(date +%s) - start)) s"

# ---- a user's file where the state file goes is not overwritten
echo '{"mine": true}' >"$tmp/new.jsonl.flotilla.json"
refused "user's file at the state-file path" "is not a flotilla job state file" "$tmp/new.jsonl.flotilla.json" -- \
  "${G[@]}" --output "$tmp/new.jsonl"
[ ! -e "$tmp/new.jsonl" ] && ok "no output created when refused" || bad "output created although refused"

# ---- a real job, then resumes that must match it
gen --input "$tmp/req.jsonl" --output "$tmp/res.jsonl" 2>"$tmp/log"
rc=$?
if [ $rc -eq 0 ] && [ "$(wc -l <"$tmp/res.jsonl")" -eq 3 ] && python3 - "$tmp/res.jsonl.flotilla.json" "$tmp/req.jsonl" <<'PY'
import json, os, sys
s = json.load(open(sys.argv[1]))
assert s["flotilla_batch_job"] == 1
assert s["input"]["path"] == os.path.realpath(sys.argv[2]), s
assert int(s["input"]["bytes"]) == os.path.getsize(sys.argv[2])
assert s["options"]["temperature"] == "0" and s["options"]["max_tokens"] == "256", s
PY
then ok "a new job writes its results and its state file"; else bad "new job (rc=$rc): $(tail -3 "$tmp/log")"; fi
if grep -q "TTFT        n/a" "$tmp/log"; then bad "summary n/a although requests ran"; fi
cp "$tmp/res.jsonl" "$tmp/res.orig"
gen --input "$tmp/req.jsonl" --output "$tmp/res.jsonl" 2>"$tmp/log"
if [ $? -eq 0 ] && cmp -s "$tmp/res.jsonl" "$tmp/res.orig" && grep -q "0 requests to go" "$tmp/log" &&
   grep -q "TTFT        n/a" "$tmp/log" && ! grep -qi nan "$tmp/log"; then
  ok "same job again: resumed, nothing to do, summary says n/a"
else
  bad "same job again: $(cat "$tmp/log")"
fi
refused "resume with other options" "holds the results of another job (option temperature: 0 vs 0.7" "$tmp/res.jsonl" -- \
  "${G[@]}" --output "$tmp/res.jsonl" --temperature 0.7 --resume
cp "$tmp/req.jsonl" "$tmp/req2.jsonl"
echo '{"custom_id": "r9", "body": {"prompt": "more"}}' >>"$tmp/req2.jsonl"
cp "$tmp/res.jsonl.flotilla.json" "$tmp/res2.jsonl.flotilla.json"
cp "$tmp/res.jsonl" "$tmp/res2.jsonl"
refused "resume with another input" "holds the results of another job (input" "$tmp/res2.jsonl" -- \
  "$fl" generate --output-format compact --model "$demo" --backend cpu --input "$tmp/req2.jsonl" --output "$tmp/res2.jsonl"
cp "$tmp/req.jsonl" "$tmp/req3.jsonl" && sed -i 's/Item 2/Item 3/' "$tmp/req3.jsonl"
cp "$tmp/res.jsonl.flotilla.json" "$tmp/res3.jsonl.flotilla.json"
sed "s#$(python3 -c "import os;print(os.path.realpath('$tmp/req.jsonl'))")#$(python3 -c "import os;print(os.path.realpath('$tmp/req3.jsonl'))")#" \
  "$tmp/res.jsonl.flotilla.json" >"$tmp/res3.jsonl.flotilla.json"
cp "$tmp/res.jsonl" "$tmp/res3.jsonl"
refused "resume with an input of the same size, other bytes" "input hash" "$tmp/res3.jsonl" -- \
  "$fl" generate --output-format compact --model "$demo" --backend cpu --input "$tmp/req3.jsonl" --output "$tmp/res3.jsonl"
gen --input "$tmp/req.jsonl" --output "$tmp/res.jsonl" --temperature 0.7 --force 2>"$tmp/log"
if [ $? -eq 0 ] && cmp -s "$tmp/res.jsonl" "$tmp/res.orig" && grep -q -- "--force: continuing" "$tmp/log" &&
   grep -q '"temperature":	"0.7"' "$tmp/res.jsonl.flotilla.json"; then
  ok "--force continues another job's file (appending only) and records this job"
else
  bad "--force: $(cat "$tmp/log")"
fi

# ---- a results file without its state file
cp "$tmp/res.orig" "$tmp/copy.jsonl"
refused "results without a state file" "add --resume to continue it" "$tmp/copy.jsonl" -- "${G[@]}" --output "$tmp/copy.jsonl"
gen --input "$tmp/req.jsonl" --output "$tmp/copy.jsonl" --resume 2>"$tmp/log"
if [ $? -eq 0 ] && cmp -s "$tmp/copy.jsonl" "$tmp/res.orig" && grep -q "no job state file" "$tmp/log" &&
   [ -f "$tmp/copy.jsonl.flotilla.json" ]; then
  ok "--resume adopts a results file of this input (unchanged, state file written)"
else
  bad "adoption: $(cat "$tmp/log")"
fi
{ head -n 2 "$tmp/res.orig"; echo '{"custom_id":"zz","text":"x","prompt_tokens":1,"completion_tokens":1,"finish_reason":"stop"}'; } >"$tmp/other.jsonl"
refused "results of other ids are not adopted" "other.jsonl exists and was not written by this job" "$tmp/other.jsonl" -- \
  "${G[@]}" --output "$tmp/other.jsonl" --resume
cp "$tmp/res.orig" "$tmp/torn.jsonl" && printf '{"custom_id":"r1","text":"hal' >>"$tmp/torn.jsonl"
refused "a torn line is not adopted without a state file" "torn.jsonl exists and was not written" "$tmp/torn.jsonl" -- \
  "${G[@]}" --output "$tmp/torn.jsonl" --resume

cp "$tmp/res.orig" "$tmp/ow.jsonl"
echo '{"custom_id": "one", "body": {"prompt": "Hi", "max_tokens": 1}}' >"$tmp/one.jsonl"
gen --input "$tmp/one.jsonl" --output "$tmp/ow.jsonl" --overwrite 2>"$tmp/log" </dev/null
if [ $? -eq 0 ] && [ "$(wc -l <"$tmp/ow.jsonl")" -eq 1 ] && grep -q '"custom_id":"one"' "$tmp/ow.jsonl"; then
  ok "--overwrite of a results file without a state file (every line a result)"
else
  bad "--overwrite of an old results file: $(tail -3 "$tmp/log")"
fi
refused "--overwrite of a torn results file without a state file" "refusing to truncate" "$tmp/torn.jsonl" -- \
  "${G[@]}" --output "$tmp/torn.jsonl" --overwrite

# ---- standard output
# (run in $tmp: a file named "-" would land there)
(cd "$tmp" && gen --input "$tmp/req.jsonl" --output - >"$tmp/stdout.jsonl" 2>"$tmp/log")
if [ $? -eq 0 ] && cmp -s "$tmp/stdout.jsonl" "$tmp/res.orig" && [ ! -e "$tmp/-" ] && [ ! -e "$tmp/-.flotilla.json" ]; then
  ok "--output - writes the results to standard output"
else
  bad "--output -: $(tail -3 "$tmp/log")"
fi
refused "--output - --resume" "cannot be resumed" /dev/null -- "${G[@]}" --output - --resume

# ---- escaped NUL: refused per request, naming the field
cat >"$tmp/nul.jsonl" <<'EOF'
{"custom_id": "p", "body": {"prompt": "ab\u0000cd", "max_tokens": 2}}
{"custom_id": "m", "body": {"messages": [{"role": "user", "content": "x\u0000y"}]}}
{"custom_id": "s", "body": {"prompt": "ab", "stop": ["q", "\u0000"]}}
{"custom_id": "ok", "body": {"prompt": "a\\u0000b", "max_tokens": 2}}
EOF
gen --input "$tmp/nul.jsonl" --output "$tmp/nul.out" 2>"$tmp/log"
if [ $? -eq 0 ] && python3 - "$tmp/nul.out" <<'PY'
import json, sys
r = {x["custom_id"]: x for x in map(json.loads, open(sys.argv[1]))}
for k, f in (("p", "body.prompt"), ("m", "body.messages[0].content"), ("s", "body.stop[1]")):
    assert f"nul.jsonl:" in r[k]["error"]["message"] and f"{f} contains an escaped NUL" in r[k]["error"]["message"], r[k]
assert "error" not in r["ok"] and r["ok"]["completion_tokens"] == 2, r["ok"]
PY
then ok "escaped NUL in prompt, message, stop: error records naming the field"; else bad "escaped NUL: $(cat "$tmp/nul.out") $(tail -2 "$tmp/log")"; fi
printf '["fine", "cut\\u0000here"]' >"$tmp/tok.json"
refused "tokenize: escaped NUL" "element 1 contains an escaped NUL" /dev/null -- "$fl" tokenize --model "$demo" --input "$tmp/tok.json"

# ---- loaded metadata is checked
python3 - "$demo" "$tmp/eos.gguf" <<'PY'
import struct, sys
d = bytearray(open(sys.argv[1], "rb").read())
k = b"tokenizer.ggml.eos_token_id"
i = d.find(k) + len(k)
assert struct.unpack_from("<I", d, i)[0] == 4  # uint32
struct.pack_into("<I", d, i + 4, 99999)
open(sys.argv[2], "wb").write(d)
PY
refused "inspect: GGUF eos id outside the vocabulary" "tokenizer.ggml.eos_token_id = 99999 is outside the vocabulary (49152 tokens" /dev/null -- \
  "$fl" inspect --model "$tmp/eos.gguf"
refused "generate: GGUF eos id outside the vocabulary" "tokenizer.ggml.eos_token_id = 99999" /dev/null -- \
  "$fl" generate --output-format compact --model "$tmp/eos.gguf" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/eos.out"
mkdir -p "$tmp/layers"
ln -s "$src/tests/golden/llama/model.safetensors" "$tmp/layers/model.safetensors"
python3 -c "
import json; c = json.load(open('$src/tests/golden/llama/config.json')); c['num_hidden_layers'] = 300
json.dump(c, open('$tmp/layers/config.json', 'w'))"
refused "inspect: num_hidden_layers above the tensors" "num_hidden_layers = 300, but the checkpoint has tensors for 3 layers" /dev/null -- \
  "$fl" inspect --model "$tmp/layers"
echo '[1, 2, 3]' >"$tmp/ids.json"
refused "logits: the same contradiction" "num_hidden_layers = 300" /dev/null -- \
  "$fl" logits --model "$tmp/layers" --input-ids "$tmp/ids.json" --output "$tmp/l.f32" --backend cpu
# experts stored fused (one [experts, 2 x inter, hidden] tensor a layer) are refused, named
mkdir -p "$tmp/fused"
cp "$src/tests/golden/qwen2_moe/config.json" "$tmp/fused/"
python3 - "$tmp/fused/model.safetensors" <<'PY'
import json, struct, sys
n = 8 * 80 * 32 * 4
h = json.dumps({"model.layers.0.mlp.experts.gate_up_proj": {"dtype": "F32", "shape": [8, 80, 32],
                                                           "data_offsets": [0, n]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + bytes(n))
PY
refused "inspect: fused experts" 'tensor "model.layers.0.mlp.experts.gate_up_proj" holds all of a layer.s experts in one tensor' \
  /dev/null -- "$fl" inspect --model "$tmp/fused"

# ---- progress counts a request that is still decoding
echo '{"custom_id": "long", "body": {"prompt": "Once upon a time", "max_tokens": 24}}' >"$tmp/long.jsonl"
gen --input "$tmp/long.jsonl" --output "$tmp/long.out" --progress-interval 0.05 2>"$tmp/log"
if [ $? -eq 0 ] && python3 - "$tmp/log" <<'PY'
import re, sys
lines = [l for l in open(sys.argv[1]) if "progress 0/1 requests" in l]
toks = [int(re.search(r"(\d+) output tokens", l).group(1)) for l in lines]
assert toks and max(toks) > 0, lines[-3:]
# while decoding, an ETA is known (the request's share done), not "?"
assert any(not l.rstrip().endswith("ETA ?") for l in lines if int(re.search(r"(\d+) output tokens", l).group(1)) > 0)
PY
then ok "progress counts the tokens of a request in flight ($(grep -c 'progress 0/1' "$tmp/log") lines at 0/1)"
else bad "progress while decoding: $(grep progress "$tmp/log" | tail -3)"; fi

# ---- the smaller things
refused "missing --input named" "missing --input" /dev/null -- "$fl" generate --output-format compact --model "$demo" --output "$tmp/x"
refused "missing --model and --output named" "missing --model, --output" /dev/null -- "$fl" generate --input "$tmp/req.jsonl"
"$fl" inspect --help >"$tmp/help"
if grep -q -- "--model" "$tmp/help" && ! grep -Eq -- "--(threads|kv-cache-mb|max-num-seqs|tp|backend)" "$tmp/help"; then
  ok "inspect --help lists no engine option"
else
  bad "inspect --help: $(cat "$tmp/help")"
fi
"$fl" generate --help >"$tmp/help"
if grep -q "second one ends the process at once (exit 130" "$tmp/help" && grep -q "OUTPUT.flotilla.json" "$tmp/help" &&
   grep -q -- "--force" "$tmp/help"; then
  ok "generate --help documents the output files and the second signal"
else
  bad "generate --help: $(tail -20 "$tmp/help")"
fi

finish
