#!/usr/bin/env bash
# test_serve_load.sh FLOTILLA SRC — a loopback load test of `flotilla serve`
# on the demo model (CPU): tests/check_serve_load.py sends 64 requests at
# once (completions and chat, whole and streamed) and checks every answer
# against the same request alone, prints p50/p99 latency, then checks
# /metrics (parsed with prometheus_client: tests/prom_check.py).
# Under sanitizers each request asks for 1 token (a token costs about half
# a CPU second there); the client count stays 64. The server runs with
# --stream-stall-timeout 2, so slow engine steps must not count as stalls.
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
max_tokens=12
ldd "$fl" 2>/dev/null | grep -Eq 'lib(a|ub)san' && max_tokens=1

if fl_start_serve "$tmp/serve.log" "$fl" serve --model "$demo" --backend cpu --port 0 --max-num-seqs 64 \
     --max-concurrent-requests 64 --stream-stall-timeout 2; then
  if timeout 600 python3 "$src/tests/check_serve_load.py" "$port" "$fl" "$demo" 64 "$max_tokens" \
       >"$tmp/check.log" 2>&1; then
    ok "$(grep -c '^ok' "$tmp/check.log") load checks; $(grep '^# 64' "$tmp/check.log" | cut -c3-)"
  else
    bad "load checks: $(tail -5 "$tmp/check.log")"
  fi
  grep '^#' "$tmp/check.log"
  if grep -q "read nothing" "$tmp/serve.log"; then
    bad "a stream was dropped as stalled: $(grep 'read nothing' "$tmp/serve.log" | head -2)"
  else
    ok "no stream was taken for stalled"
  fi
  kill -TERM "$spid"
  timeout 120 tail --pid="$spid" -f /dev/null
  wait "$spid"
  rc=$?
  spid=
  [ "$rc" = 0 ] && ok "SIGTERM: exit 0" || bad "SIGTERM: exit $rc: $(tail -3 "$tmp/serve.log")"
else
  bad "serve did not start: $(tail -5 "$tmp/serve.log")"
fi
finish
