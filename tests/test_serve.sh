#!/usr/bin/env bash
# test_serve.sh FLOTILLA SRC — `flotilla serve` on the demo model (CPU):
# starts it on a free port (--port 0, the port read from its start line),
# then tests/check_serve.py checks every endpoint against `flotilla
# generate`'s greedy answers to the same bodies: completions and chat, whole
# and streamed, n and logprobs, the errors (400/401/404/405/413), metrics,
# concurrent streams with one client hanging up, the openai client; then
# SIGTERM must end the server with exit 0. On a fixture with a small KV
# cache, tests/check_serve_swap.py checks the preemption metrics. tests/check_serve_http.py sends
# malformed HTTP to a server with a short --timeout-keep-alive. Also --help
# and bad flags.
# Prints "N passed, M failed".
set -u
fl=$1
src=$2
tmp=$(mktemp -d)
spid=
cleanup() {
  [ -n "$spid" ] && kill -9 "$spid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
. "$src/tests/lib.sh"
fl_require_demo "$src"
sanitized=0
ldd "$fl" 2>/dev/null | grep -Eq 'lib(a|ub)san' && sanitized=1
if [ $sanitized = 1 ]; then clients=8; else clients=16; fi

# the expected greedy answers, from the batch path
cat >"$tmp/req.jsonl" <<'J'
{"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}}
{"custom_id": "h", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}}
J
if timeout 300 "$fl" generate --model "$demo" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/out.jsonl" 2>"$tmp/gen.log"; then
  ok "generate gives the reference answers"
else
  bad "generate: $(tail -3 "$tmp/gen.log")"
fi
python3 - "$tmp/out.jsonl" "$clients" >"$tmp/expected.json" <<'PY'
import json, sys
r = {json.loads(l)["custom_id"]: json.loads(l)["response"]["body"] for l in open(sys.argv[1])}
print(json.dumps({"prompt": "The capital of France is", "max_tokens": 8,
                  "messages": [{"role": "user", "content": "Say hi"}], "clients": int(sys.argv[2]),
                  "completion": r["c"]["choices"][0]["text"],
                  "chat": r["h"]["choices"][0]["message"]["content"]}))
PY

# stop_server: SIGTERM, bounded wait; $rc = the exit status
stop_server() {
  kill -TERM "$spid"
  timeout 120 tail --pid="$spid" -f /dev/null
  wait "$spid"
  rc=$?
  spid=
}

if fl_start_serve "$tmp/serve.log" "$fl" serve --model "$demo" --backend cpu --port 0 --api-key sekret \
     --served-model-name smol --max-body-bytes 4096 --max-num-seqs 32 --max-concurrent-requests 64; then
  ok "serve starts and prints its port ($port)"
  if timeout 600 python3 "$src/tests/check_serve.py" "$port" sekret "$tmp/expected.json" >"$tmp/check.log" 2>&1; then
    ok "$(grep -c '^ok' "$tmp/check.log") endpoint checks"
  else
    bad "endpoint checks: $(tail -5 "$tmp/check.log")"
  fi
  stop_server
  if [ "$rc" = 0 ] && grep -q "flotilla serve: stopped" "$tmp/serve.log"; then
    ok "SIGTERM: exit 0"
  else
    bad "SIGTERM: exit $rc: $(tail -3 "$tmp/serve.log")"
  fi
else
  bad "serve did not start: $(tail -5 "$tmp/serve.log")"
fi

# SIGTERM while a request is in flight: it is finished, then exit 0
if fl_start_serve "$tmp/serve2.log" "$fl" serve --model "$demo" --backend cpu --port 0; then
  python3 - "$port" >"$tmp/inflight.json" 2>&1 <<'PY' &
import http.client, json, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=300)
c.request("POST", "/v1/completions", body=json.dumps({"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}))
r = c.getresponse()
print(json.dumps({"status": r.status, "body": json.loads(r.read())}))
PY
  cpid=$!
  for _ in $(seq 1 100); do
    python3 -c "import urllib.request,sys; t=urllib.request.urlopen('http://127.0.0.1:$port/metrics',timeout=5).read().decode(); sys.exit(0 if 'flotilla_requests_running 1' in t else 1)" 2>/dev/null && break
    sleep 0.1
  done
  stop_server
  wait "$cpid"
  if [ "$rc" = 0 ] && python3 -c "
import json; o = json.load(open('$tmp/inflight.json'))
assert o['status'] == 200 and o['body']['usage']['completion_tokens'] == 24, o"; then
    ok "SIGTERM with a request in flight: it completes, exit 0"
  else
    bad "SIGTERM in flight: exit $rc, $(cat "$tmp/inflight.json") $(tail -2 "$tmp/serve2.log")"
  fi
else
  bad "serve did not start: $(tail -5 "$tmp/serve2.log")"
fi

# malformed and hostile HTTP against a short --timeout-keep-alive
if fl_start_serve "$tmp/serve3.log" "$fl" serve --model "$demo" --backend cpu --port 0 --timeout-keep-alive 2; then
  if timeout 600 python3 "$src/tests/check_serve_http.py" "$port" 2 >"$tmp/http.log" 2>&1; then
    ok "$(grep -c '^ok' "$tmp/http.log") malformed-HTTP checks (slow, idle, half-closed clients, bad Content-Length)"
  else
    bad "malformed-HTTP checks: $(tail -5 "$tmp/http.log")"
  fi
  stop_server
  [ "$rc" = 0 ] || bad "SIGTERM after the malformed-HTTP checks: exit $rc: $(tail -3 "$tmp/serve3.log")"
else
  bad "serve did not start: $(tail -5 "$tmp/serve3.log")"
fi

# preemption: 32 requests of about 110 tokens each on a byte-tokenizer
# fixture whose 1 MiB cache holds 1365 tokens (768 bytes a token, 12 KiB a
# block), as tests/test_swap_generate.sh does for generate; /metrics counts
# the swaps by kind and the bytes moved (tests/check_serve_swap.py)
# the default pool, then --swap-space 0
fl_byte_model "$src" llama "$tmp/llama"
for mode in swap recompute; do
  extra=()
  [ $mode = recompute ] && extra=(--swap-space 0)
  if fl_start_serve "$tmp/serve_$mode.log" "$fl" serve --model "$tmp/llama" --backend cpu --port 0 --kv-cache-mb 1 \
       --max-num-seqs 64 --max-concurrent-requests 64 "${extra[@]}"; then
    if timeout 300 python3 "$src/tests/check_serve_swap.py" "$port" 32 12288 $mode >"$tmp/$mode.log" 2>&1; then
      ok "$(grep -c '^ok' "$tmp/$mode.log") preemption metrics checks, $mode ($(grep '^# preemptions' "$tmp/$mode.log" | cut -c3-))"
    else
      bad "preemption metrics checks, $mode: $(tail -5 "$tmp/$mode.log")"
    fi
    stop_server
    [ "$rc" = 0 ] || bad "SIGTERM after the $mode checks: exit $rc: $(tail -3 "$tmp/serve_$mode.log")"
  else
    bad "serve did not start on the fixture: $(tail -5 "$tmp/serve_$mode.log")"
  fi
done

# the command line
if "$fl" serve --help | grep -q -- "--max-concurrent-requests" && "$fl" serve --help | grep -q -- "--api-key"; then
  ok "serve --help documents the options"
else
  bad "serve --help"
fi
if ! "$fl" serve --model "$demo" --port 70000 2>"$tmp/e" && grep -q "port" "$tmp/e"; then
  ok "--port 70000 refused naming the flag"
else
  bad "--port 70000: $(cat "$tmp/e")"
fi
if ! "$fl" serve --model "$demo" --timeout-keep-alive 0 2>"$tmp/e" && grep -q "timeout-keep-alive" "$tmp/e"; then
  ok "--timeout-keep-alive 0 refused naming the flag"
else
  bad "--timeout-keep-alive 0: $(cat "$tmp/e")"
fi
finish
