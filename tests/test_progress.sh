#!/usr/bin/env bash
# test_progress.sh FLOTILLA SRC — progress and summary of `flotilla generate`
# (issue 5) on the demo model: off a terminal, plain progress lines every
# --progress-interval seconds and the summary; --summary FILE.json agrees
# with the results written; on a terminal (a pseudo-terminal through
# script(1)), a bar redrawn in place with \r instead of lines.
# Prints "N passed, M failed".
set -u
fl=$1
src=$2
demo=${FL_DEMO_GGUF:-$src/models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   - $1"; }
bad() { fail=$((fail + 1)); echo "FAIL - $1"; }
if [ ! -f "$demo" ]; then
  echo "FAIL - demo model missing at $demo (scripts/fetch_demo_model.sh)"
  exit 1
fi
# sanitizer builds (scripts/test.sh) run the model ~50x slower: smaller batch
sanitized=0
ldd "$fl" 2>/dev/null | grep -Eq 'lib(a|ub)san' && sanitized=1
if [ $sanitized = 1 ]; then N=8; else N=32; fi
python3 - "$N" >"$tmp/req.jsonl" <<'PY'
import json, sys
for i in range(int(sys.argv[1])):
    print(json.dumps({"custom_id": f"p{i}", "body": {"prompt": f"Fact {i}: cats", "max_tokens": 6}}))
PY

# off a terminal: lines, no \r, the summary, the JSON
"$fl" generate --output-format compact --model "$demo" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/out.jsonl" \
  --progress-interval 0.3 --summary "$tmp/s.json" 2>"$tmp/err" </dev/null
rc=$?
if [ $rc -eq 0 ] && grep -Eq "^flotilla generate: progress [0-9]+/$N requests, [0-9]+ output tokens, [0-9.]+ tok/s, elapsed [0-9]+:[0-9]{2}, ETA " "$tmp/err" &&
   ! grep -q $'\r' "$tmp/err"; then
  ok "progress lines off a terminal ($(grep -c progress "$tmp/err") lines, e.g. $(grep -m1 progress "$tmp/err"))"
else
  bad "progress lines (rc=$rc): $(cat "$tmp/err")"
fi
if grep -q "^flotilla generate: done: $N requests ($N ok, 0 errors" "$tmp/err" &&
   grep -Eq "^  TTFT +p50 [0-9.]+ s, p90 [0-9.]+ s, p99 [0-9.]+ s" "$tmp/err" &&
   grep -Eq "^  TPOT +p50 [0-9.]+ ms, p90 [0-9.]+ ms, p99 [0-9.]+ ms" "$tmp/err" &&
   grep -Eq "^  wall time +[0-9.]+ s, [0-9.]+ output tok/s" "$tmp/err"; then
  ok "text summary"
else
  bad "text summary: $(cat "$tmp/err")"
fi
if msg=$(python3 - "$tmp/s.json" "$tmp/out.jsonl" "$N" <<'PY' 2>&1
import json, sys
s = json.load(open(sys.argv[1]))
recs = [json.loads(l) for l in open(sys.argv[2])]
n = int(sys.argv[3])
assert s["requests"] == n == len(recs) and s["ok"] == n and s["errors"] == 0, s
assert s["interrupted"] is False and s["dropped"] == 0 and s["already_done"] == 0, s
assert s["input_tokens"] == sum(r["prompt_tokens"] for r in recs), s
assert s["output_tokens"] == sum(r["completion_tokens"] for r in recs), s
assert s["wall_seconds"] > 0 and abs(s["output_tokens_per_second"] - s["output_tokens"] / s["wall_seconds"]) < 1e-6 * s["output_tokens_per_second"] + 1e-9, s
for k in ("ttft_seconds", "tpot_seconds"):
    p = s[k]
    assert 0 < p["p50"] <= p["p90"] <= p["p99"] < s["wall_seconds"], (k, p)
print(f"{s['output_tokens']} tokens, TTFT p50 {s['ttft_seconds']['p50']:.3f} s")
PY
); then
  ok "--summary JSON agrees with the results ($msg)"
else
  bad "--summary JSON: $msg"
fi

# on a pseudo-terminal: the bar, redrawn with \r, no progress lines
rm -f "$tmp/out2.jsonl"
script -qec "'$fl' generate --output-format compact --model '$demo' --backend cpu --input '$tmp/req.jsonl' --output '$tmp/out2.jsonl'" \
  "$tmp/typescript" >/dev/null 2>&1 </dev/null
rc=$?
if [ $rc -eq 0 ] && grep -aEq $'\r\\[[#.]{30}\\] [0-9]+/'"$N"' req \| [0-9.]+ tok/s \| [0-9:]+ elapsed \| ETA ' "$tmp/typescript" &&
   grep -aq $'\r\\[##############################\\] '"$N/$N"' req' "$tmp/typescript" &&
   ! grep -aq "progress [0-9]*/" "$tmp/typescript" && grep -aq "done: $N requests" "$tmp/typescript" &&
   [ "$(wc -l <"$tmp/out2.jsonl")" -eq "$N" ]; then
  ok "progress bar on a terminal ($(grep -ao $'\r\\[' "$tmp/typescript" | wc -l) redraws)"
else
  bad "progress bar (rc=$rc): $(tr '\r' '~' <"$tmp/typescript" | head -c 600)"
fi

# bad values are refused naming the flag
"$fl" generate --output-format compact --model "$demo" --input "$tmp/req.jsonl" --output "$tmp/x" --progress-interval never 2>"$tmp/err" >/dev/null
if [ $? -ne 0 ] && grep -q "progress-interval" "$tmp/err"; then ok "bad --progress-interval refused"; else bad "bad --progress-interval: $(cat "$tmp/err")"; fi
head -n 2 "$tmp/req.jsonl" >"$tmp/two.jsonl"
"$fl" generate --output-format compact --model "$demo" --input "$tmp/two.jsonl" --output "$tmp/x" --summary /nonexistent/dir/s.json \
  --max-tokens 1 2>"$tmp/err" >/dev/null
if [ $? -ne 0 ] && grep -q "/nonexistent/dir/s.json" "$tmp/err"; then ok "unwritable --summary reported"; else bad "unwritable --summary: $(cat "$tmp/err")"; fi

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
