#!/usr/bin/env bash
# test_perplexity.sh FLOTILLA SRC — `flotilla perplexity` on the `llama`
# golden fixture with a byte-level tokenizer: for each (ctx, stride) of
# tests/golden/llama/perplexity.json (transformers in float64,
# tests/golden/make_perplexity_ref.py) the CPU backend's perplexity must agree
# within 1e-4 relative and score the same tokens in the same number of
# windows; the same under mpirun -np 2 --tp 2 (heads 8 / kv 2); bad input
# (empty file, ctx < 2, stride > ctx, text of one token, missing file) is
# refused with a line naming it. Prints "N passed, M failed".
set -u
fl=$1
src=$2
. "$src/tests/lib.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fl_byte_model "$src" llama "$tmp/m"
fx=$src/tests/golden/llama
txt=$fx/perplexity.txt

# agree REF_JSON CASE_INDEX OUT_JSON: prints the relative difference, fails beyond 1e-4
agree() {
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
ref = json.load(open(sys.argv[1]))["cases"][int(sys.argv[2])]
got = json.load(open(sys.argv[3]))
rel = abs(got["perplexity"] - ref["perplexity"]) / ref["perplexity"]
print(f"ppl {got['perplexity']:.6f} vs {ref['perplexity']:.6f}, rel {rel:.1e}, "
      f"{got['scored_tokens']} tokens, {got['windows']} windows")
same = all(got[k] == ref[k] for k in ("scored_tokens", "windows", "ctx", "stride"))
sys.exit(0 if rel <= 1e-4 and same else 1)
PY
}

n_cases=$(python3 -c "import json; print(len(json.load(open('$fx/perplexity.json'))['cases']))")
for ((i = 0; i < n_cases; i++)); do
  read -r ctx stride < <(python3 -c "import json; c = json.load(open('$fx/perplexity.json'))['cases'][$i]; print(c['ctx'], c['stride'])")
  flags=(--ctx "$ctx")
  [ "$stride" != "$ctx" ] && flags+=(--stride "$stride")
  rm -f "$tmp/o.json"
  if out=$("$fl" perplexity --model "$tmp/m" --input "$txt" "${flags[@]}" --backend cpu --output "$tmp/o.json" 2>"$tmp/err") &&
     msg=$(agree "$fx/perplexity.json" "$i" "$tmp/o.json"); then
    ok "ctx $ctx stride $stride: $msg"
  else
    bad "ctx $ctx stride $stride: $(tail -2 "$tmp/err") ${msg:-}"
  fi
  # the printed line carries the same numbers
  if [ "$i" = 0 ]; then
    case "$out" in
      "perplexity: "*" over "*" tokens (ctx $ctx)") ok "printed line: $out" ;;
      *) bad "printed line: '$out'" ;;
    esac
  fi
done

# tensor parallel on the CPU backend: the default window and overlapping ones
fl_mpi_env
for i in 0 2; do
  read -r ctx stride < <(python3 -c "import json; c = json.load(open('$fx/perplexity.json'))['cases'][$i]; print(c['ctx'], c['stride'])")
  rm -f "$tmp/o.json"
  if timeout 120 mpirun --oversubscribe --bind-to none -np 2 "$fl" perplexity --model "$tmp/m" --input "$txt" \
       --ctx "$ctx" --stride "$stride" --backend cpu --tp 2 --output "$tmp/o.json" >"$tmp/log" 2>&1 &&
     msg=$(agree "$fx/perplexity.json" "$i" "$tmp/o.json") &&
     [ "$(grep -c '^perplexity:' "$tmp/log")" = 1 ]; then
    ok "mpirun -np 2 --tp 2 ctx $ctx stride $stride: $msg"
  else
    bad "mpirun -np 2 --tp 2 ctx $ctx stride $stride: $(tail -3 "$tmp/log") ${msg:-}"
  fi
done

# refused: each with exit status 1 and a line naming the problem
refuse() { # NAME EXPECTED_TEXT ARGS...
  local name=$1 want=$2
  shift 2
  "$fl" perplexity --model "$tmp/m" --backend cpu "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ "$rc" = 1 ] && grep -q -- "$want" "$tmp/err"; then
    ok "$name refused: $(head -1 "$tmp/err")"
  else
    bad "$name: exit $rc, stderr: $(head -3 "$tmp/err")"
  fi
}
: >"$tmp/empty.txt"
printf 'A' >"$tmp/one.txt"
refuse "empty file" "empty.txt: the file is empty" --input "$tmp/empty.txt"
refuse "ctx 1" "ctx" --input "$txt" --ctx 1
refuse "stride > ctx" "stride" --input "$txt" --ctx 8 --stride 9
refuse "one-token text" "one.txt: 1 token; perplexity needs at least 2" --input "$tmp/one.txt"
refuse "missing file" "$tmp/nope.txt" --input "$tmp/nope.txt"
refuse "no --input" "--input" --ctx 8
# and under mpirun the error is printed once, the job ends
if timeout 120 mpirun --oversubscribe --bind-to none -np 2 "$fl" perplexity --model "$tmp/m" --input "$tmp/one.txt" \
     --backend cpu --tp 2 >"$tmp/log" 2>&1; then
  bad "mpirun one-token text: exit 0"
elif [ "$(grep -c 'perplexity needs at least 2' "$tmp/log")" = 1 ]; then
  ok "mpirun one-token text refused once"
else
  bad "mpirun one-token text: $(tail -5 "$tmp/log")"
fi
finish
