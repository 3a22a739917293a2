#!/usr/bin/env bash
# test_serve_mpi.sh FLOTILLA SRC — `flotilla serve` under mpirun -np 3 --tp 3
# on the CPU backend (demo model, 9 heads: tp 3): rank 0 serves, ranks 1-2
# follow its plans;
# a greedy completion equals the single-rank answer (`flotilla generate`),
# and SIGTERM to every rank (as Slurm sends it) ends every rank with exit 0.
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
fl_mpi_env
fl_require_demo "$src"

echo '{"custom_id": "c", "body": {"prompt": "The capital of France is", "max_tokens": 8}}' >"$tmp/req.jsonl"
timeout 300 "$fl" generate --model "$demo" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/out.jsonl" \
  2>"$tmp/gen.log" || bad "generate: $(tail -3 "$tmp/gen.log")"

timeout 600 mpirun --oversubscribe --bind-to none -np 3 "$fl" serve --model "$demo" --backend cpu --tp 3 \
  --port 0 2>"$tmp/serve.log" &
spid=$!
port=
for _ in $(seq 1 900); do
  port=$(sed -n 's|^flotilla serve: listening on http://[^:]*:\([0-9]*\) .*|\1|p' "$tmp/serve.log")
  [ -n "$port" ] && break
  kill -0 "$spid" 2>/dev/null || break
  sleep 0.2
done
if [ -n "$port" ]; then
  ok "3 ranks: rank 0 listens on port $port"
  if python3 - "$port" "$tmp/out.jsonl" <<'PY'; then
import http.client, json, sys
want = json.loads(open(sys.argv[2]).readline())["response"]["body"]["choices"][0]["text"]
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=300)
c.request("POST", "/v1/completions", body=json.dumps({"prompt": "The capital of France is", "max_tokens": 8}))
r = c.getresponse()
got = json.loads(r.read())
assert r.status == 200 and got["choices"][0]["text"] == want, (r.status, got, want)
PY
    ok "--tp 3 completion equals the single-rank answer"
  else
    bad "--tp 3 completion differs"
  fi
  # SIGTERM to every rank; mpirun ends with 0 when every rank does
  # $spid is timeout(1); its child is mpirun, whose children are the ranks
  ranks=$(for c in $(pgrep -P "$spid"); do pgrep -P "$c"; done)
  [ -n "$ranks" ] && kill -TERM $ranks
  timeout 120 tail --pid="$spid" -f /dev/null
  wait "$spid"
  rc=$?
  spid=
  if [ $rc = 0 ] && grep -q "flotilla serve: stopped" "$tmp/serve.log"; then
    ok "SIGTERM: every rank exits 0"
  else
    bad "SIGTERM: exit $rc: $(tail -3 "$tmp/serve.log")"
  fi
else
  bad "serve under mpirun did not start: $(tail -5 "$tmp/serve.log")"
fi
finish
