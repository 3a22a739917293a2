#!/usr/bin/env bash
# test_serve_stall.sh FLOTILLA SRC — `flotilla serve --stream-stall-timeout 2`
# on the demo model (CPU): tests/check_serve_stall.py opens a stream whose
# client never reads; the server must drop it, stop its sequence and count
# it in /metrics while another client's stream completes. Also the option's
# bounds. Prints "N passed, M failed".
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

if fl_start_serve "$tmp/serve.log" "$fl" serve --model "$demo" --backend cpu --port 0 --stream-stall-timeout 2; then
  if timeout 600 python3 "$src/tests/check_serve_stall.py" "$port" 2 >"$tmp/check.log" 2>&1; then
    ok "$(grep -c '^ok' "$tmp/check.log") stalled-client checks: $(grep 'dropped' "$tmp/check.log")"
  else
    bad "stalled-client checks: $(tail -5 "$tmp/check.log")"
  fi
  if grep -q "the client read nothing for 2 s" "$tmp/serve.log"; then
    ok "the server's log names the dropped stream"
  else
    bad "no log line for the dropped stream: $(tail -3 "$tmp/serve.log")"
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

if ! "$fl" serve --model "$demo" --stream-stall-timeout 0 2>"$tmp/e" && grep -q "stream-stall-timeout" "$tmp/e"; then
  ok "--stream-stall-timeout 0 refused naming the flag"
else
  bad "--stream-stall-timeout 0: $(cat "$tmp/e")"
fi
"$fl" serve --help | grep -q -- "--stream-stall-timeout" && ok "serve --help documents it" || bad "serve --help"
finish
