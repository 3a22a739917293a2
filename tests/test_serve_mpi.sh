#!/usr/bin/env bash
# test_serve_mpi.sh FLOTILLA SRC — `flotilla serve` under mpirun on the CPU
# backend (demo model), with -np 3 --tp 3 (9 heads: rank 0 serves, ranks 1-2
# follow its plans) and -np 2 --dp 2 (rank 0 schedules both replicas):
# greedy completions sent at once equal the single-rank answers (`flotilla
# generate`), and SIGTERM to every rank (as Slurm sends it) ends every rank
# with exit 0. Prints "N passed, M failed".
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

python3 - >"$tmp/req.jsonl" <<'PY'
import json
for i, p in enumerate(["The capital of France is", "Water boils at", "The largest planet is", "One, two, three,"]):
    print(json.dumps({"custom_id": f"c{i}", "body": {"prompt": p, "max_tokens": 8}}))
PY
timeout 300 "$fl" generate --model "$demo" --backend cpu --input "$tmp/req.jsonl" --output "$tmp/out.jsonl" \
  2>"$tmp/gen.log" || bad "generate: $(tail -3 "$tmp/gen.log")"

serve_layout() { # NP LABEL FLAGS...
  local np=$1 label=$2 log=$tmp/serve-$1.log
  shift 2
  if ! fl_start_serve "$log" timeout 600 mpirun --oversubscribe --bind-to none -np "$np" "$fl" serve \
       --model "$demo" --backend cpu "$@" --port 0; then
    bad "$label: serve under mpirun did not start: $(tail -5 "$log")"
    return
  fi
  ok "$label, $np ranks: rank 0 listens on port $port"
  if python3 - "$port" "$tmp/out.jsonl" <<'PY'; then
import http.client, json, sys, threading
want = {}
for line in open(sys.argv[2]):
    o = json.loads(line)
    want[o["custom_id"]] = o["response"]["body"]["choices"][0]["text"]
prompts = ["The capital of France is", "Water boils at", "The largest planet is", "One, two, three,"]
got, errs = {}, []
def ask(i):
    try:
        c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=300)
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": prompts[i], "max_tokens": 8}))
        r = c.getresponse()
        b = json.loads(r.read())
        got[f"c{i}"] = b["choices"][0]["text"] if r.status == 200 else (r.status, b)
    except Exception as e:
        errs.append(repr(e))
ts = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
for t in ts: t.start()
for t in ts: t.join()
assert not errs and got == want, (errs, got, want)
PY
    ok "$label: 4 completions at once equal the single-rank answers"
  else
    bad "$label: completions differ"
  fi
  # SIGTERM to every rank; mpirun ends with 0 when every rank does
  # $spid is timeout(1); its child is mpirun, whose children are the ranks
  local ranks rc
  ranks=$(for c in $(pgrep -P "$spid"); do pgrep -P "$c"; done)
  [ -n "$ranks" ] && kill -TERM $ranks
  timeout 120 tail --pid="$spid" -f /dev/null
  wait "$spid"
  rc=$?
  spid=
  if [ $rc = 0 ] && grep -q "flotilla serve: stopped" "$log"; then
    ok "$label: SIGTERM: every rank exits 0"
  else
    bad "$label: SIGTERM: exit $rc: $(tail -3 "$log")"
  fi
}

serve_layout 3 "--tp 3" --tp 3
serve_layout 2 "--dp 2" --dp 2
finish
