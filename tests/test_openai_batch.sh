#!/usr/bin/env bash
# test_openai_batch.sh FLOTILLA SRC — `flotilla generate` speaks OpenAI's
# Batch format on the demo model: completions and chat requests with n = 3,
# logprobs, sampling and penalties, and a refused field, checked by
# tests/check_openai_batch.py, which knows only OpenAI's format (and uses the
# official openai types when installed); the checker rejects tampered copies
# (negative controls); a job cut short resumes to one record per request; the
# output format is part of the job's identity; compact refuses n > 1 per
# request. Prints "N passed, M failed".
set -u
fl=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. "$src/tests/lib.sh"
fl_require_demo "$src"
gen() { timeout 300 "$fl" generate --model "$demo" --backend cpu "$@"; }
check() { python3 "$src/tests/check_openai_batch.py" "$@"; }

cat >"$tmp/req.jsonl" <<'J'
{"custom_id": "cg", "method": "POST", "url": "/v1/completions", "body": {"model": "smol", "prompt": "The capital of France is", "max_tokens": 5, "n": 3, "logprobs": 5, "ignore_eos": true}}
{"custom_id": "cs", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once upon a time", "max_tokens": 4, "n": 3, "logprobs": 2, "temperature": 1.0, "seed": 3, "stop": ["\n\n"]}}
{"custom_id": "hg", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "n": 3, "logprobs": true, "top_logprobs": 4}}
{"custom_id": "hs", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Name a color"}], "max_completion_tokens": 4, "n": 2, "temperature": 0.7, "logprobs": true, "top_logprobs": 0, "presence_penalty": 1.0, "frequency_penalty": 0.5, "min_tokens": 2}}
{"custom_id": "plain", "body": {"prompt": "1, 2, 3,", "max_tokens": 3, "user": "u1", "metadata": {"k": "v"}}}
{"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}}
J

if gen --input "$tmp/req.jsonl" --output "$tmp/out.jsonl" 2>"$tmp/log"; then
  ok "generate exits 0"
else
  bad "generate: $(tail -3 "$tmp/log")"
fi
if check "$tmp/req.jsonl" "$tmp/out.jsonl" >"$tmp/chk"; then
  ok "$(sed "s/^ok *- //" "$tmp/chk")"
else
  bad "OpenAI format check: $(cat "$tmp/chk")"
fi
if grep '"custom_id":"bad"' "$tmp/out.jsonl" | grep -q '"status_code":400' &&
   grep '"custom_id":"bad"' "$tmp/out.jsonl" | grep -q '"param":"response_format"'; then
  ok "an unsupported field is refused with an OpenAI error object naming it"
else
  bad "refusal record: $(grep '"bad"' "$tmp/out.jsonl")"
fi

# negative controls: the checker must reject a dropped choice, unsorted or
# positive logprobs, and a wrong usage sum
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
recs = [json.loads(l) for l in open(f"{d}/out.jsonl")]
def write(name, f):
    out = []
    for r in recs:
        r = json.loads(json.dumps(r))
        f(r)
        out.append(json.dumps(r))
    open(f"{d}/{name}.jsonl", "w").write("\n".join(out) + "\n")
def body(r, cid):
    return r["response"]["body"] if r["custom_id"] == cid else None
def drop(r):
    b = body(r, "cg")
    if b: b["choices"].pop()
def unsort(r):
    b = body(r, "hg")
    if b: b["choices"][0]["logprobs"]["content"][0]["top_logprobs"].reverse()
def positive(r):
    b = body(r, "cs")
    if b: b["choices"][1]["logprobs"]["token_logprobs"][0] = 0.5
def usage(r):
    b = body(r, "plain")
    if b: b["usage"]["total_tokens"] += 1
for n, f in [("t_drop", drop), ("t_unsort", unsort), ("t_pos", positive), ("t_usage", usage)]:
    write(n, f)
PY
for t in t_drop t_unsort t_pos t_usage; do
  if check "$tmp/req.jsonl" "$tmp/$t.jsonl" >"$tmp/chk" 2>&1; then
    bad "checker accepted the tampered copy $t"
  else
    ok "checker rejects $t: $(head -c 120 "$tmp/chk")"
  fi
done

# resume: a job cut after two records completes to one record per request
head -2 "$tmp/out.jsonl" >"$tmp/cut.jsonl"
cp "$tmp/out.jsonl.flotilla.json" "$tmp/cut.jsonl.flotilla.json"
if gen --input "$tmp/req.jsonl" --output "$tmp/cut.jsonl" 2>"$tmp/log" &&
   grep -q "resuming.*2 results already written" "$tmp/log" &&
   check "$tmp/req.jsonl" "$tmp/cut.jsonl" >"$tmp/chk" &&
   [ "$(head -2 "$tmp/cut.jsonl")" = "$(head -2 "$tmp/out.jsonl")" ]; then
  ok "a cut OpenAI-format job resumes to one valid record per request"
else
  bad "resume: $(tail -3 "$tmp/log") / $(cat "$tmp/chk")"
fi

# the output format is part of the job's identity
if gen --input "$tmp/req.jsonl" --output "$tmp/out.jsonl" --output-format compact 2>"$tmp/log"; then
  bad "compact run on an openai-format job's output was not refused"
else
  grep -q "output_format" "$tmp/log" && ok "another --output-format is another job: refused" ||
    bad "format change refused without naming it: $(tail -2 "$tmp/log")"
fi

# compact: today's lines; n > 1 refused per request, naming the field
printf '%s\n' '{"custom_id": "a", "body": {"prompt": "Hi", "max_tokens": 2}}' \
  '{"custom_id": "b", "body": {"prompt": "Hi", "max_tokens": 2, "n": 2}}' >"$tmp/c.jsonl"
if gen --input "$tmp/c.jsonl" --output "$tmp/c.out" --output-format compact 2>"$tmp/log" &&
   python3 - "$tmp/c.out" <<'PY'
import json, sys
recs = {r["custom_id"]: r for r in map(json.loads, open(sys.argv[1]))}
a, b = recs["a"], recs["b"]
assert set(a) == {"custom_id", "text", "prompt_tokens", "completion_tokens", "finish_reason"}, a
assert "body.n" in b["error"]["message"], b
PY
then
  ok "--output-format compact keeps the old lines and refuses n > 1 naming body.n"
else
  bad "compact: $(cat "$tmp/c.out" 2>/dev/null) $(tail -2 "$tmp/log")"
fi
finish
