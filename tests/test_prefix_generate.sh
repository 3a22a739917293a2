#!/usr/bin/env bash
# test_prefix_generate.sh FLOTILLA SRC — prefix caching through `flotilla
# generate`: with it on (the default) and off (--no-prefix-caching, or
# `prefix_caching: false` in a --config file) the outputs are the same, on
# one rank and under mpirun (tp 2; dp 2, where each replica has its own
# cache); the summary (text and --summary JSON) and the progress lines
# report the hit rate, and for a constructed workload (8 requests behind
# one 64-token prefix, admitted in one step) it is the number the block
# rule gives: 7 x (the prefix's whole blocks) / all prompt tokens. The
# golden Llama and DeepSeek-V2 (MLA) fixtures run with a byte-level
# tokenizer (one token per character); the demo model with a shared system
# prompt. Prints "N passed, M failed".
set -u
fl=$1
src=$2
demo=${FL_DEMO_GGUF:-$src/models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. "$src/tests/lib.sh"
fl_mpi_env
mpi() { timeout 300 mpirun --oversubscribe --bind-to none -np "$@"; }

# 8 requests: one 64-character prefix, suffixes of 3..17 characters; 48
# tokens each, so the run outlasts the 0.01 s progress interval
python3 - >"$tmp/req.jsonl" <<'PY'
import json
prefix = "You answer in one word. Context: the sky is blue; grass is green. "[:64]
assert len(prefix) == 64
for i in range(8):
    q = f"Q{i}: colour{' of it' * (i % 3)}?"
    print(json.dumps({"custom_id": f"r{i}", "body": {"prompt": prefix + q, "max_tokens": 48}}))
PY

# the hit rate a summary must report: requests after the first share the
# prefix's whole blocks (block 16), at most prompt_tokens - 1 of them
expect() { # out.jsonl summary.json want_cached(0: none) -> message, status
  python3 - "$@" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
s = json.load(open(sys.argv[2]))
n = [r["prompt_tokens"] for r in sorted(recs, key=lambda r: int(r["custom_id"][1:]))]
extra = n[0] - len("You answer in one word. Context: the sky is blue; grass is green. "[:64] + "Q0: colour?")
shared = 64 + extra  # BOS, when the tokenizer adds one, is part of the prefix
want = sum(min(shared // 16, (k - 1) // 16) * 16 for k in n[1:]) if sys.argv[3] == "1" else 0
assert s["prefix_prompt_tokens"] == sum(n) == s["input_tokens"], (s, n)
assert s["prefix_cached_tokens"] == want, (s["prefix_cached_tokens"], want)
assert abs(s["prefix_hit_rate"] - want / sum(n)) < 1e-12, s
print(f"{want} of {sum(n)} prompt tokens cached, hit rate {s['prefix_hit_rate']:.4f}")
PY
}

for fx in llama deepseek_v2; do
  m=$tmp/$fx
  fl_byte_model "$src" "$fx" "$m"
  gen() { # name extra-args...
    local name=$1
    shift
    rm -f "$tmp/$fx.$name.jsonl"
    "$fl" generate --output-format compact --model "$m" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/$fx.$name.jsonl" \
      --summary "$tmp/$fx.$name.json" --progress-interval 0.01 "$@" >"$tmp/$fx.$name.log" 2>&1
  }
  gen on && gen off --no-prefix-caching || { bad "$fx generate: $(tail -3 "$tmp/$fx.on.log" "$tmp/$fx.off.log")"; continue; }
  if [ -s "$tmp/$fx.on.jsonl" ] && [ "$(sort "$tmp/$fx.on.jsonl")" = "$(sort "$tmp/$fx.off.jsonl")" ]; then
    ok "$fx: outputs with prefix caching equal those without"
  else
    bad "$fx: outputs differ: $(cat "$tmp/$fx.on.jsonl" "$tmp/$fx.off.jsonl")"
  fi
  if msg=$(expect "$tmp/$fx.on.jsonl" "$tmp/$fx.on.json" 1 2>&1) &&
     msg0=$(expect "$tmp/$fx.off.jsonl" "$tmp/$fx.off.json" 0 2>&1); then
    ok "$fx: summary hit rate on: $msg; off: $msg0"
  else
    bad "$fx: summary hit rate: $msg ${msg0:-}"
  fi
  if grep -Eq '^  prefix hit +[0-9.]+% of prompt tokens \([0-9]+ of [0-9]+ from the KV cache\)' "$tmp/$fx.on.log" &&
     grep -Eq '^flotilla generate: progress .*, prefix hit [0-9.]+%$' "$tmp/$fx.on.log"; then
    ok "$fx: text summary and progress lines report the hit rate ($(grep '^  prefix hit' "$tmp/$fx.on.log"))"
  else
    bad "$fx: hit rate in the text: $(cat "$tmp/$fx.on.log")"
  fi
  # the same layouts under mpirun: tp 2 (one cache: 7 requests share the
  # prefix's 4 blocks; with DeepSeek-V2's experts also split over ep 2),
  # dp 2 (one cache per replica, 4 requests each: the first in each replica
  # computes the prefix, 6 share it)
  lays=("--tp 2" "--dp 2")
  [ "$fx" = deepseek_v2 ] && lays+=("--tp 2 --ep 2")
  for lay in "${lays[@]}"; do
    want=$([ "$lay" = "--dp 2" ] && echo $((6 * 64)) || echo $((7 * 64)))
    for mode in on off; do
      flag=()
      [ $mode = off ] && flag=(--no-prefix-caching)
      rm -f "$tmp/mpi.$mode.jsonl"
      mpi 2 "$fl" generate --output-format compact --model "$m" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/mpi.$mode.jsonl" \
        --summary "$tmp/mpi.$mode.json" $lay "${flag[@]}" >"$tmp/mpi.log" 2>&1 || bad "$fx $lay $mode: $(tail -3 "$tmp/mpi.log")"
    done
    hits=$(python3 -c "import json; print(json.load(open('$tmp/mpi.on.json'))['prefix_cached_tokens'])" 2>/dev/null)
    if [ -s "$tmp/mpi.on.jsonl" ] && [ "$(sort "$tmp/mpi.on.jsonl")" = "$(sort "$tmp/$fx.on.jsonl")" ] &&
       [ "$(sort "$tmp/mpi.off.jsonl")" = "$(sort "$tmp/$fx.on.jsonl")" ] && [ "${hits:-0}" -eq "$want" ]; then
      ok "$fx mpirun -np 2 $lay: on and off equal one rank ($hits prompt tokens cached)"
    else
      bad "$fx mpirun -np 2 $lay: $(cat "$tmp/mpi.on.jsonl" "$tmp/mpi.off.jsonl") hits=${hits:-?}, want $want"
    fi
  done
done

# the YAML key: prefix_caching: false turns it off; a bad value names file, line and key
m=$tmp/llama
printf 'prefix_caching: false\n' >"$tmp/off.yaml"
rm -f "$tmp/y.jsonl"
"$fl" generate --output-format compact --model "$m" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/y.jsonl" \
  --summary "$tmp/y.json" --config "$tmp/off.yaml" >"$tmp/y.log" 2>&1
if [ $? -eq 0 ] && msg=$(expect "$tmp/y.jsonl" "$tmp/y.json" 0 2>&1) &&
   [ "$(sort "$tmp/y.jsonl")" = "$(sort "$tmp/llama.on.jsonl")" ]; then
  ok "config prefix_caching: false: $msg, same outputs"
else
  bad "config prefix_caching: false: $(cat "$tmp/y.log") ${msg:-}"
fi
printf 'prefix_caching: true\n' >"$tmp/on.yaml"
rm -f "$tmp/y.jsonl"
"$fl" generate --output-format compact --model "$m" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/y.jsonl" \
  --summary "$tmp/y.json" --config "$tmp/on.yaml" >"$tmp/y.log" 2>&1
if [ $? -eq 0 ] && msg=$(expect "$tmp/y.jsonl" "$tmp/y.json" 1 2>&1); then
  ok "config prefix_caching: true: $msg"
else
  bad "config prefix_caching: true: $(cat "$tmp/y.log") ${msg:-}"
fi
printf 'max_num_seqs: 4\nprefix_caching: sometimes\n' >"$tmp/bad.yaml"
"$fl" generate --output-format compact --model "$m" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/z.jsonl" \
  --config "$tmp/bad.yaml" >"$tmp/z.log" 2>&1
if [ $? -ne 0 ] && grep -q "bad.yaml:2: prefix_caching must be true or false, got 'sometimes'" "$tmp/z.log"; then
  ok "config prefix_caching: sometimes refused ($(head -1 "$tmp/z.log"))"
else
  bad "bad prefix_caching value: $(cat "$tmp/z.log")"
fi

# the demo model: a shared system prompt in chat requests
if [ -f "$demo" ]; then
  python3 - >"$tmp/chat.jsonl" <<'PY'
import json
system = ("You are a helpful assistant for a grocery shop. Answer briefly and politely, "
          "name prices in euros, and never invent products the shop does not sell.")
for i, q in enumerate(["Do you sell apples?", "When do you open?", "Is there parking?", "Do you deliver?"]):
    print(json.dumps({"custom_id": f"c{i}", "body": {"messages": [
        {"role": "system", "content": system}, {"role": "user", "content": q}], "max_tokens": 5}}))
PY
  for mode in on off; do
    flag=()
    [ $mode = off ] && flag=(--no-prefix-caching)
    "$fl" generate --output-format compact --model "$demo" --backend cpu --input "$tmp/chat.jsonl" --output "$tmp/demo.$mode.jsonl" \
      --summary "$tmp/demo.$mode.json" "${flag[@]}" >"$tmp/demo.log" 2>&1 || bad "demo $mode: $(tail -3 "$tmp/demo.log")"
  done
  hits=$(python3 -c "import json; print(json.load(open('$tmp/demo.on.json'))['prefix_cached_tokens'])" 2>/dev/null)
  off=$(python3 -c "import json; print(json.load(open('$tmp/demo.off.json'))['prefix_cached_tokens'])" 2>/dev/null)
  if [ -s "$tmp/demo.on.jsonl" ] && [ "$(sort "$tmp/demo.on.jsonl")" = "$(sort "$tmp/demo.off.jsonl")" ] &&
     [ "${hits:-0}" -ge 48 ] && [ "${off:-1}" -eq 0 ]; then
    ok "demo model: chat requests with one system prompt give the same text on and off ($hits prompt tokens cached)"
  else
    bad "demo model on/off: hits=${hits:-?} off=${off:-?} $(cat "$tmp/demo.on.jsonl" "$tmp/demo.off.jsonl")"
  fi
else
  bad "demo model missing at $demo"
fi

finish
