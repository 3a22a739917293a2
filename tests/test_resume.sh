#!/usr/bin/env bash
# test_resume.sh FLOTILLA SRC — resumable batch jobs (issue 5) on the demo
# model: an uninterrupted run is the reference; a 3-rank job (mpirun -np 3
# --tp 3) is killed with SIGKILL midway, a torn half record is appended as a
# kill mid-write would leave it, and a rerun with --resume must give every
# custom_id (and every id-less error record) exactly once, results equal to
# the reference (greedy), no torn line. Also: duplicate custom_ids refused at
# load time naming both lines; a foreign file refused, not truncated; an
# invalid-JSON last line cut and redone; --overwrite starts over. A copy of
# an output is the same job when its state file (OUT.flotilla.json) comes
# with it; which files a job may touch at all: test_output_safety.sh.
# Prints "N passed, M failed".
set -u
fl=$1
src=$2
tmp=$(mktemp -d)
mpipid=
cleanup() {
  [ -n "$mpipid" ] && kill -9 "$mpipid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
. "$src/tests/lib.sh"
fl_mpi_env
fl_require_demo "$src"
gen() { "$fl" generate --output-format compact --model "$demo" --backend cpu --max-num-seqs "$MNS" "$@"; }

# N short requests, plus one malformed request with an id and one line that
# is not JSON (its error record has custom_id null and is keyed by line)
# sanitizer builds (scripts/test.sh) run the model ~50x slower: smaller batch
sanitized=0
ldd "$fl" 2>/dev/null | grep -Eq 'lib(a|ub)san' && sanitized=1
if [ $sanitized = 1 ]; then N=16 MNS=4; else N=80 MNS=16; fi
N=${FL_RESUME_N:-$N}
echo "# $N requests, --max-num-seqs $MNS (sanitized build: $sanitized)"
python3 - "$N" >"$tmp/req.jsonl" <<'PY'
import json, sys
n = int(sys.argv[1])
for i in range(n):
    if i == 7:
        print(json.dumps({"custom_id": "bad7", "body": {"messages": "not a list"}}))
    elif i == 11:
        print("this line is not json")
    else:
        print(json.dumps({"custom_id": f"r{i}", "body": {"prompt": f"Item {i}: the", "max_tokens": 4 + i % 4}}))
PY

# check OUT: every line valid JSON ending in \n, ids exactly once, equal to the reference
check_against_ref() {
  python3 - "$tmp/req.jsonl" "$tmp/ref.jsonl" "$1" <<'PY'
import json, sys
inp, ref, out = sys.argv[1:]
raw = open(out, "rb").read()
assert raw.endswith(b"\n"), "last line not terminated"
def load(p):
    recs = {}
    for n, line in enumerate(open(p, encoding="utf-8"), 1):
        r = json.loads(line)  # raises on a torn line
        key = r["custom_id"] if r["custom_id"] is not None else f"line{r['error']['line']}"
        assert key not in recs, f"{p}:{n}: {key} twice"
        recs[key] = r
    return recs
a, b = load(ref), load(out)
n_in = sum(1 for l in open(inp) if l.strip())
assert len(a) == n_in, f"reference has {len(a)} records for {n_in} requests"
assert a.keys() == b.keys(), f"missing {sorted(a.keys() - b.keys())[:5]} extra {sorted(b.keys() - a.keys())[:5]}"
diff = [k for k in a if a[k] != b[k]]
assert not diff, f"{len(diff)} results differ, e.g. {a[diff[0]]} vs {b[diff[0]]}"
print(f"{len(b)} records, all equal")
PY
}

gen --input "$tmp/req.jsonl" --output "$tmp/ref.jsonl" 2>"$tmp/log"
rc=$?
if [ $rc -eq 0 ] && msg=$(check_against_ref "$tmp/ref.jsonl" 2>&1) && grep -q '"custom_id":null' "$tmp/ref.jsonl"; then
  ok "reference run ($msg, id-less error record present)"
else
  bad "reference run (rc=$rc): $msg $(tail -3 "$tmp/log")"
fi

# rerunning a finished job does nothing and leaves the file byte-identical
# (a copy of a job's output is the same job when its state file comes along)
cp "$tmp/ref.jsonl" "$tmp/again.jsonl"
cp "$tmp/ref.jsonl.flotilla.json" "$tmp/again.jsonl.flotilla.json"
gen --input "$tmp/req.jsonl" --output "$tmp/again.jsonl" 2>"$tmp/log"
if [ $? -eq 0 ] && cmp -s "$tmp/ref.jsonl" "$tmp/again.jsonl" && grep -q "0 requests to go" "$tmp/log"; then
  ok "rerun of a finished job writes nothing"
else
  bad "rerun of a finished job: $(cat "$tmp/log")"
fi

# kill -9 a 3-rank job midway
rm -f "$tmp/kill.jsonl"
timeout 300 mpirun --oversubscribe --bind-to none -np 3 "$fl" generate --output-format compact --model "$demo" --backend cpu --max-num-seqs "$MNS" \
  --tp 3 --input "$tmp/req.jsonl" --output "$tmp/kill.jsonl" >"$tmp/mpilog" 2>&1 &
mpipid=$!
half=$((N / 3))
for _ in $(seq 1 1200); do
  n=0; [ -f "$tmp/kill.jsonl" ] && n=$(wc -l <"$tmp/kill.jsonl")
  [ "$n" -ge "$half" ] && break
  kill -0 "$mpipid" 2>/dev/null || break
  sleep 0.1
done
# every rank at once, as a node failure would (killing only mpirun could
# leave rank 0 writing on while the restart runs)
# $mpipid is timeout(1); its child is mpirun, whose children are the ranks
ranks=$(for c in $(pgrep -P "$mpipid"); do pgrep -P "$c"; done)
[ -n "$ranks" ] && kill -9 $ranks
kill -9 "$mpipid" 2>/dev/null
wait "$mpipid" 2>/dev/null
mpipid=
n_killed=$(wc -l <"$tmp/kill.jsonl")
if [ "$n_killed" -ge "$half" ] && [ "$n_killed" -lt "$N" ] && [ "$(echo $ranks | wc -w)" -eq 3 ]; then
  ok "killed the 3-rank job with $n_killed of $N results written"
else
  bad "kill midway: $n_killed of $N results written, ranks $ranks: $(tail -5 "$tmp/mpilog")"
fi
# a record torn by a kill mid-write, for a request not written yet
todo=$(python3 -c "
import json,sys
done={json.loads(l)['custom_id'] for l in open('$tmp/kill.jsonl')}
print(next(f'r{i}' for i in range($N) if f'r{i}' not in done and i not in (7, 11)))")
printf '{"custom_id":"%s","text":" half a rec' "$todo" >>"$tmp/kill.jsonl"
timeout 300 mpirun --oversubscribe --bind-to none -np 3 "$fl" generate --output-format compact --model "$demo" --backend cpu --max-num-seqs "$MNS" \
  --tp 3 --input "$tmp/req.jsonl" --output "$tmp/kill.jsonl" --resume >"$tmp/mpilog" 2>&1
rc=$?
if [ $rc -eq 0 ] && msg=$(check_against_ref "$tmp/kill.jsonl" 2>&1) && grep -q "torn last line" "$tmp/mpilog"; then
  ok "resume after kill -9 on 3 ranks: $msg, torn record for $todo redone"
else
  bad "resume after kill -9 (rc=$rc): $msg / $(tail -5 "$tmp/mpilog")"
fi

# a complete-looking last line that is not JSON is also cut and redone
head -n 20 "$tmp/ref.jsonl" >"$tmp/t.jsonl"
cp "$tmp/ref.jsonl.flotilla.json" "$tmp/t.jsonl.flotilla.json"
echo '{"custom_id":"r50","text":"trunc' >>"$tmp/t.jsonl"
gen --input "$tmp/req.jsonl" --output "$tmp/t.jsonl" 2>"$tmp/log"
rc=$?
if [ $rc -eq 0 ] && msg=$(check_against_ref "$tmp/t.jsonl" 2>&1); then
  ok "invalid-JSON last line cut and redone ($msg)"
else
  bad "invalid last line (rc=$rc): $msg / $(tail -3 "$tmp/log")"
fi

# garbage before other records: not ours, refused, file untouched
{ head -n 5 "$tmp/ref.jsonl"; echo 'garbage'; sed -n 6,10p "$tmp/ref.jsonl"; } >"$tmp/foreign.jsonl"
cp "$tmp/foreign.jsonl" "$tmp/foreign.orig"
cp "$tmp/ref.jsonl.flotilla.json" "$tmp/foreign.jsonl.flotilla.json"
gen --input "$tmp/req.jsonl" --output "$tmp/foreign.jsonl" >/dev/null 2>"$tmp/log"
rc=$?
if [ $rc -ne 0 ] && grep -q "foreign.jsonl:6: not a flotilla result" "$tmp/log" && cmp -s "$tmp/foreign.jsonl" "$tmp/foreign.orig"; then
  ok "foreign output refused, untouched ($(head -c 120 "$tmp/log"))"
else
  bad "foreign output (rc=$rc): $(cat "$tmp/log")"
fi

# duplicate custom_ids: refused before the model loads, naming both lines
{ head -n 4 "$tmp/req.jsonl"; echo '{"custom_id": "r2", "body": {"prompt": "again"}}'; } >"$tmp/dup.jsonl"
start=$(date +%s.%N)
gen --input "$tmp/dup.jsonl" --output "$tmp/dup.out" >/dev/null 2>"$tmp/log"
rc=$?
if [ $rc -ne 0 ] && [ "$(wc -l <"$tmp/log")" -eq 1 ] && grep -q 'duplicate custom_id "r2" at .*dup.jsonl:3 and .*dup.jsonl:5' "$tmp/log" &&
   [ ! -s "$tmp/dup.out" ]; then
  ok "duplicate custom_id refused: $(cat "$tmp/log")"
else
  bad "duplicate custom_id (rc=$rc): $(cat "$tmp/log")"
fi
# the same through stdin (no pre-pass: found when reached)
gen --input - --output "$tmp/dup2.out" <"$tmp/dup.jsonl" >/dev/null 2>"$tmp/log"
rc=$?
if [ $rc -ne 0 ] && grep -q 'duplicate custom_id "r2" at -:3 and -:5' "$tmp/log"; then
  ok "duplicate custom_id on stdin refused"
else
  bad "duplicate on stdin (rc=$rc): $(cat "$tmp/log")"
fi

# --overwrite starts over; --resume with --overwrite is refused
head -n 3 "$tmp/req.jsonl" >"$tmp/small.jsonl"
cp "$tmp/ref.jsonl" "$tmp/ow.jsonl"
cp "$tmp/ref.jsonl.flotilla.json" "$tmp/ow.jsonl.flotilla.json"
gen --input "$tmp/small.jsonl" --output "$tmp/ow.jsonl" --overwrite 2>/dev/null
if [ $? -eq 0 ] && [ "$(wc -l <"$tmp/ow.jsonl")" -eq 3 ] &&
   [ "$(sort "$tmp/ow.jsonl")" = "$(grep -E '"custom_id":"r[012]"' "$tmp/ref.jsonl" | sort)" ]; then
  ok "--overwrite starts over"
else
  bad "--overwrite: $(cat "$tmp/ow.jsonl")"
fi
gen --input "$tmp/small.jsonl" --output "$tmp/ow.jsonl" --overwrite --resume >/dev/null 2>"$tmp/log"
if [ $? -ne 0 ] && grep -q "contradict" "$tmp/log"; then ok "--resume --overwrite refused"; else bad "--resume --overwrite: $(cat "$tmp/log")"; fi

finish
