#!/usr/bin/env bash
# test_signals.sh FLOTILLA SRC — SIGTERM/SIGINT during `flotilla generate`
# (issue 5) on the demo model: the job stops admitting, finishes
# (--on-signal finish, the default) or drops (--on-signal drop) the requests
# in flight, exits 0 within a bounded time with every written line complete,
# and a --resume run then completes the job with every custom_id once. Also
# on 3 ranks (mpirun -np 3 --tp 3) with the signal sent to every rank, as
# Slurm does on preemption and at the time limit.
# Prints "N passed, M failed".
set -u
fl=$1
src=$2
tmp=$(mktemp -d)
bgpid=
cleanup() {
  [ -n "$bgpid" ] && kill -9 "$bgpid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
. "$src/tests/lib.sh"
fl_mpi_env
fl_require_demo "$src"
# sanitizer builds (scripts/test.sh) run the model ~50x slower: smaller batch
sanitized=0
ldd "$fl" 2>/dev/null | grep -Eq 'lib(a|ub)san' && sanitized=1
# the in-flight window is 4 x max_num_seqs: it must be well below N - FIRST
if [ $sanitized = 1 ]; then N=16 MNS=2 FIRST=2; else N=100 MNS=16 FIRST=10; fi
echo "# $N requests, --max-num-seqs $MNS (sanitized build: $sanitized)"
python3 - "$N" >"$tmp/req.jsonl" <<'PY'
import json, sys
for i in range(int(sys.argv[1])):
    print(json.dumps({"custom_id": f"s{i}", "body": {"prompt": f"Story {i}: once", "max_tokens": 6}}))
PY

# every line complete JSON, ids unique and from the input; prints the count
check_lines() {
  python3 - "$1" "$N" <<'PY'
import json, sys
raw = open(sys.argv[1], "rb").read()
assert raw == b"" or raw.endswith(b"\n"), "last line not terminated"
ids = [json.loads(l)["custom_id"] for l in raw.decode().splitlines()]
assert len(ids) == len(set(ids)), "an id twice"
assert set(ids) <= {f"s{i}" for i in range(int(sys.argv[2]))}
print(len(ids))
PY
}

# wait until FILE has LINES lines (or the job ended)
wait_lines() {
  for _ in $(seq 1 1500); do
    [ -f "$1" ] && [ "$(wc -l <"$1")" -ge "$2" ] && return 0
    kill -0 "$bgpid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# SIG MODE: signal a single-rank job midway
one_rank() {
  local sig=$1 mode=$2 out=$tmp/$1-$2.jsonl
  "$fl" generate --output-format compact --model "$demo" --backend cpu --max-num-seqs "$MNS" --input "$tmp/req.jsonl" --output "$out" \
    --on-signal "$mode" --summary "$tmp/s.json" 2>"$tmp/err" &
  bgpid=$!
  wait_lines "$out" "$FIRST"
  local t0 n_at_signal
  t0=$(date +%s)
  kill "-$sig" "$bgpid"
  n_at_signal=$(wc -l <"$out")
  # bounded: the in-flight window (4 x max_num_seqs) at 6 tokens each
  timeout 120 tail --pid="$bgpid" -f /dev/null
  wait "$bgpid"
  local rc=$? took=$(($(date +%s) - t0))
  bgpid=
  local n
  if n=$(check_lines "$out" 2>&1) && [ $rc -eq 0 ] && [ "$n" -lt "$N" ] && [ "$n" -ge "$n_at_signal" ] &&
     grep -q "signal" "$tmp/err" && grep -q "interrupted" "$tmp/err" &&
     python3 -c "
import json,sys; s=json.load(open('$tmp/s.json'))
assert s['interrupted'] is True
assert (s['dropped'] > 0) == ('$mode' == 'drop'), s
assert s['ok'] == $n" 2>"$tmp/pyerr"; then
    ok "SIG$sig --on-signal $mode: exit 0 in ${took}s, $n complete lines ($n_at_signal at the signal)"
  else
    bad "SIG$sig $mode (rc=$rc, n=$n, ${took}s): $(tail -4 "$tmp/err") $(cat "$tmp/pyerr")"
  fi
  # the rest on resume: every id exactly once
  "$fl" generate --output-format compact --model "$demo" --backend cpu --max-num-seqs "$MNS" --input "$tmp/req.jsonl" --output "$out" --resume 2>"$tmp/err"
  rc=$?
  if n=$(check_lines "$out" 2>&1) && [ $rc -eq 0 ] && [ "$n" -eq "$N" ]; then
    ok "resume after SIG$sig ($mode): all $N ids once"
  else
    bad "resume after SIG$sig $mode (rc=$rc): $n $(tail -3 "$tmp/err")"
  fi
}
one_rank TERM finish
one_rank INT drop

# 3 ranks, SIGTERM to every rank (as Slurm sends it); mpirun must end with 0
out=$tmp/mpi.jsonl
timeout 300 mpirun --oversubscribe --bind-to none -np 3 "$fl" generate --output-format compact --model "$demo" --backend cpu --max-num-seqs "$MNS" \
  --tp 3 --input "$tmp/req.jsonl" --output "$out" >"$tmp/err" 2>&1 &
bgpid=$!
wait_lines "$out" "$FIRST"
t0=$(date +%s)
# $bgpid is timeout(1); its child is mpirun, whose children are the ranks
ranks=$(for c in $(pgrep -P "$bgpid"); do pgrep -P "$c"; done)
[ -n "$ranks" ] && kill -TERM $ranks
timeout 120 tail --pid="$bgpid" -f /dev/null
wait "$bgpid"
rc=$?
took=$(($(date +%s) - t0))
bgpid=
if n=$(check_lines "$out" 2>&1) && [ $rc -eq 0 ] && [ "$n" -lt "$N" ] && [ "$(echo $ranks | wc -w)" -eq 3 ] &&
   grep -q "interrupted" "$tmp/err"; then
  ok "SIGTERM to all 3 ranks: mpirun exit 0 in ${took}s, $n complete lines"
else
  bad "SIGTERM on 3 ranks (rc=$rc, ranks=$ranks, n=$n, ${took}s): $(tail -5 "$tmp/err")"
fi

finish
