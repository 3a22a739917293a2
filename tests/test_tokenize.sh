#!/usr/bin/env bash
# test_tokenize.sh FLOTILLA SRC — `flotilla tokenize` gives Hugging Face
# tokenizers' encode(text, add_special_tokens=False) ids: special tokens
# written in the text ("<|im_start|>") become their ids, and with
# --split-special (HF split_special_tokens=True) they are split as plain
# text. Checked on the HF reference ids of tests/tokenizer/ (added_corpus.json,
# written by scripts/make_tok_fixtures.py) for every tokenizer.json fixture,
# and on the demo GGUF's own tokenizer. Prints "N passed, M failed".
set -u
fl=$1
src=$2
. "$src/tests/lib.sh"
fl_require_demo "$src"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fx=$src/tests/tokenizer

# same_ids NAME GOT.json REF.json FIELD: GOT equals the FIELD of every case
same_ids() {
  if python3 - "$2" "$3" "$4" <<'PY'; then ok "$1"; else bad "$1"; fi
import json, sys
got = json.load(open(sys.argv[1]))
want = [c[sys.argv[3]] for c in json.load(open(sys.argv[2]))["cases"]]
bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
if len(got) != len(want) or bad:
    print(f"  {len(got)} results for {len(want)} cases; differing cases: {bad[:10]}", file=sys.stderr)
    sys.exit(1)
PY
}

for name in llama3 qwen2 gpt2 llama2 mistral misc_bl misc_spm flags_plain flags_nfc flags_spm; do
  "$fl" tokenize --tokenizer "$fx/$name.tokenizer.json" --input "$fx/added_corpus.json" >"$tmp/$name.ids"
  same_ids "$name: ids equal HF's" "$tmp/$name.ids" "$fx/$name.added.ref.json" ids
  "$fl" tokenize --tokenizer "$fx/$name.tokenizer.json" --input "$fx/added_corpus.json" --split-special \
    >"$tmp/$name.plain"
  same_ids "$name --split-special: ids equal HF's split_special_tokens=True" "$tmp/$name.plain" \
    "$fx/$name.added.ref.json" ids_plain
done
"$fl" tokenize --model "$demo" --input "$fx/added_corpus.json" >"$tmp/demo.ids"
same_ids "demo GGUF: ids equal HF's" "$tmp/demo.ids" "$fx/smollm2.added.ref.json" ids
"$fl" tokenize --model "$demo" --input "$fx/added_corpus.json" --split-special >"$tmp/demo.plain"
same_ids "demo GGUF --split-special: ids equal HF's" "$tmp/demo.plain" "$fx/smollm2.added.ref.json" ids_plain

# the special id itself, and the literal pieces that decode back to the text
printf '["<|im_start|>"]' >"$tmp/s.json"
"$fl" tokenize --model "$demo" --input "$tmp/s.json" >"$tmp/one.ids"
id=$(python3 -c "import json; v=json.load(open('$fx/smollm2.vocab.json')); print(v['tokens'].index('<|im_start|>'))")
if [ "$(cat "$tmp/one.ids")" = "[[$id]]" ]; then ok "<|im_start|> is id $id"; else
  bad "<|im_start|> gave $(cat "$tmp/one.ids"), want [[$id]]"; fi
"$fl" tokenize --model "$demo" --input "$tmp/s.json" --split-special >"$tmp/lit.ids"
"$fl" tokenize --model "$demo" --input "$tmp/lit.ids" --decode >"$tmp/lit.txt"
if python3 -c "
import json, sys
ids = json.load(open('$tmp/lit.ids'))[0]
sys.exit(not (len(ids) > 1 and $id not in ids and json.load(open('$tmp/lit.txt')) == ['<|im_start|>']))"; then
  ok "--split-special: <|im_start|> as literal pieces $(cat "$tmp/lit.ids")"
else
  bad "--split-special gave $(cat "$tmp/lit.ids") decoding to $(cat "$tmp/lit.txt")"
fi

# --split-special with --decode: one clear line
"$fl" tokenize --model "$demo" --input "$tmp/one.ids" --decode --split-special >"$tmp/out" 2>"$tmp/err"
rc=$?
if [ $rc -ne 0 ] && [ "$(wc -l <"$tmp/err")" -eq 1 ] && grep -q -- "--split-special" "$tmp/err"; then
  ok "--split-special with --decode is refused"
else
  bad "--split-special with --decode (rc=$rc, stderr: $(head -c 300 "$tmp/err"))"
fi
"$fl" tokenize --help | grep -q -- "--split-special" && ok "--help documents --split-special" ||
  bad "--help lacks --split-special"
finish
