#!/usr/bin/env bash
# test_soak.sh FLOTILLA SRC — a batch job that survives repeated kill -9:
# `flotilla generate` over thousands of short requests under mpirun -np 4
# (tp 2, dp 2, CPU backend, the golden llama fixture with a byte-level
# tokenizer). While the kill phase lasts, one random rank of the running job
# is killed with SIGKILL at a random moment (during start-up, model load or
# generation), and the job is restarted with --resume on the same output.
# Then the job runs to the end, and every custom_id (and the one id-less
# error record) must appear exactly once, every record equal to an
# uninterrupted one-rank run's (greedy).
#
# Also checked after every kill: the job ends by itself (Open MPI's mpirun
# sees the rank die and takes the other ranks down; nothing of it may hang
# or linger, or a leftover rank 0 could write on during the restart), and
# every mpirun runs under a timeout, so a hang fails the test instead of
# stalling CI.
#
# Bounded for CI (about 3 minutes on 2 cores). Longer runs by hand:
#   FL_SOAK_SECONDS  length of the kill phase (default 45)
#   FL_SOAK_REQUESTS requests (default 3000; 1000 in a sanitizer build)
#   FL_SOAK_SEED     seed of the kill schedule (default: random, printed)
# Prints "N passed, M failed" and the kills survived and requests checked.
set -u
fl=$1
src=$2
tmp=$(mktemp -d)
jobpid=
. "$src/tests/lib.sh"
fl_mpi_env

# the running job's ranks: timeout(1) -> mpirun -> ranks
job_ranks() {
  local m
  for m in $(pgrep -P "$jobpid" 2>/dev/null); do pgrep -P "$m"; done
}
kill_job() {
  local r
  r=$(job_ranks)
  [ -n "$r" ] && kill -9 $r 2>/dev/null
  pkill -9 -P "$jobpid" 2>/dev/null
  kill -9 "$jobpid" 2>/dev/null
  wait "$jobpid" 2>/dev/null
  jobpid=
}
cleanup() {
  [ -n "$jobpid" ] && kill_job
  rm -rf "$tmp"
}
trap cleanup EXIT

sanitized=0
ldd "$fl" 2>/dev/null | grep -Eq 'lib(a|ub)san' && sanitized=1
if [ $sanitized = 1 ]; then N=1000; else N=3000; fi
N=${FL_SOAK_REQUESTS:-$N}
SECS=${FL_SOAK_SECONDS:-45}
seed=${FL_SOAK_SEED:-$((RANDOM * 32768 + RANDOM))}
RANDOM=$seed
# Every run of the job gets this long (a restart only has what is left to
# do); a run that takes longer is a hang.
RUN_LIMIT=$((sanitized ? 600 : 300))
echo "# $N requests, kill phase ${SECS}s, seed $seed (FL_SOAK_SEED), sanitized build: $sanitized"
t_start=$(date +%s)

model=$tmp/model
fl_byte_model "$src" llama "$model"
# short prompts and completions; one request with a bad body (an error
# record with its id) and one line that is not JSON (custom_id null, keyed
# by its line), so both kinds of record are resumed too
python3 - "$N" "$seed" >"$tmp/req.jsonl" <<'PY'
import json, random, sys
n, rnd = int(sys.argv[1]), random.Random(int(sys.argv[2]))
words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "9", "\u00e9t\u00e9"]
for i in range(n):
    if i == 13:
        print(json.dumps({"custom_id": "bad13", "body": {"messages": "not a list"}}))
    elif i == 29:
        print("this line is not json")
    else:
        p = " ".join(rnd.choice(words) for _ in range(rnd.randint(1, 5)))
        print(json.dumps({"custom_id": f"s{i}", "body": {"prompt": p, "max_tokens": rnd.randint(1, 4)}}))
PY
gen_args=(generate --output-format compact --model "$model" --backend cpu --max-num-seqs 16 --input "$tmp/req.jsonl")

# the uninterrupted reference: one rank
if timeout -k 5 "$RUN_LIMIT" "$fl" "${gen_args[@]}" --threads 1 --output "$tmp/ref.jsonl" >/dev/null \
     2>"$tmp/ref.log"; then
  ok "uninterrupted one-rank reference: $(wc -l <"$tmp/ref.jsonl") records"
else
  bad "reference run: $(tail -3 "$tmp/ref.log")"
  finish
  exit 1
fi

# start_job: the 4-rank job in the background on $tmp/out.jsonl ($1: extra flags)
start_job() {
  timeout -k 5 "$RUN_LIMIT" mpirun --oversubscribe --bind-to none -np 4 "$fl" "${gen_args[@]}" \
    --tp 2 --dp 2 --output "$tmp/out.jsonl" "$@" >>"$tmp/job.log" 2>&1 &
  jobpid=$!
}
# wait_job TENTHS: waits that many tenths of a second at most for the job
# to end; sets rc (124: still running)
wait_job() {
  local i
  for ((i = 0; i < $1; i++)); do
    kill -0 "$jobpid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$jobpid" 2>/dev/null; then
    rc=124
  else
    wait "$jobpid"
    rc=$?
    jobpid=
  fi
}

kills=0
runs=0
t_kill=$(date +%s) # the kill phase starts now, whatever the reference took
finished=0
resume=()
max_delay=60
while [ $(($(date +%s) - t_kill)) -lt "$SECS" ]; do
  runs=$((runs + 1))
  echo "--- run $runs ${resume[*]}" >>"$tmp/job.log"
  start_job "${resume[@]}"
  resume=(--resume)
  # a random moment in the run: 0.3 s to max_delay tenths after the start
  # (start-up, model load, generation), at 0.1 s resolution
  delay=$((3 + RANDOM % (max_delay - 2)))
  t_run=$(date +%s%N)
  wait_job "$delay"
  if [ "$rc" != 124 ]; then # the job ended before its kill
    if [ "$rc" = 0 ] && [ $kills = 0 ] && [ $max_delay -gt 4 ]; then
      # the whole job ran in less than the delay drawn: start over, fresh,
      # with kills drawn inside the length of that run
      took=$((($(date +%s%N) - t_run) / 100000000))
      max_delay=$((took * 3 / 4 > 4 ? took * 3 / 4 : 4))
      echo "--- run $runs finished in ${took}00 ms before its kill: starting over, kills within ${max_delay}00 ms" >>"$tmp/job.log"
      rm -f "$tmp/out.jsonl"
      resume=()
      continue
    fi
    if [ "$rc" = 0 ]; then
      finished=1
      break
    fi
    bad "run $runs ended by itself with exit $rc: $(tail -5 "$tmp/job.log")"
    break
  fi
  mapfile -t ranks < <(job_ranks)
  if [ ${#ranks[@]} -eq 0 ]; then # mpirun has not started its ranks yet
    sleep 0.2
    mapfile -t ranks < <(job_ranks)
  fi
  if [ ${#ranks[@]} -eq 0 ]; then
    kill_job # nothing to pick from: end it whole, as a node failure would
    kills=$((kills + 1))
    echo "--- run $runs: killed mpirun before its ranks started" >>"$tmp/job.log"
    continue
  fi
  victim=${ranks[RANDOM % ${#ranks[@]}]}
  lines=$(wc -l <"$tmp/out.jsonl" 2>/dev/null || echo 0)
  t0=$(date +%s%N)
  kill -9 "$victim" 2>/dev/null
  kills=$((kills + 1))
  echo "--- run $runs: killed pid $victim of ${ranks[*]} at ${delay}00 ms, $lines lines written" >>"$tmp/job.log"
  # one rank gone: the job must end by itself, promptly
  wait_job 600
  took=$((($(date +%s%N) - t0) / 1000000))
  if [ "$rc" = 124 ]; then
    bad "run $runs: the job hung after rank pid $victim was killed: $(tail -5 "$tmp/job.log")"
    kill_job
    break
  fi
  # mpirun exits as soon as it has signalled the other ranks: give them a
  # moment to go, but none may stay (a zombie waiting to be reaped is gone)
  for ((i = 0; i < 100; i++)); do
    alive=()
    for p in "${ranks[@]}"; do
      st=$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)
      [ -n "$st" ] && [ "$st" != Z ] && alive+=("$p")
    done
    [ ${#alive[@]} -eq 0 ] && break
    sleep 0.1
  done
  if [ ${#alive[@]} -ne 0 ]; then
    bad "run $runs: ranks ${alive[*]} outlived the job by 10 s after $victim was killed"
    kill -9 "${alive[@]}" 2>/dev/null
    break
  fi
  echo "--- run $runs: mpirun exited $rc $took ms after the kill, every rank gone $((i * 100)) ms later" >>"$tmp/job.log"
done
echo "# kill phase: $runs runs, $kills kills, $(wc -l <"$tmp/out.jsonl" 2>/dev/null || echo 0) lines written"

if [ "$fail" -eq 0 ] && [ "$finished" = 0 ]; then
  # the rest of the job, uninterrupted
  echo "--- final run" >>"$tmp/job.log"
  start_job "${resume[@]}"
  wait "$jobpid"
  rc=$?
  jobpid=
  if [ "$rc" = 0 ]; then
    ok "the job finished after $kills kills ($runs runs before the last)"
  else
    bad "final run (exit $rc$([ "$rc" = 124 ] && echo ": hung")): $(tail -5 "$tmp/job.log")"
  fi
elif [ "$finished" = 1 ]; then
  ok "the job finished during the kill phase after $kills kills ($runs runs)"
fi
if [ "$kills" -eq 0 ]; then
  bad "no rank was killed: raise FL_SOAK_REQUESTS or FL_SOAK_SECONDS"
fi

# every id once, every record equal to the reference
if msg=$(python3 - "$tmp/req.jsonl" "$tmp/ref.jsonl" "$tmp/out.jsonl" 2>&1 <<'PY'
import json, sys
inp, ref, out = sys.argv[1:]
raw = open(out, "rb").read()
assert raw.endswith(b"\n"), "last line not terminated"
def load(p):
    recs = {}
    for n, line in enumerate(open(p, encoding="utf-8"), 1):
        r = json.loads(line)  # a torn line fails here
        key = r["custom_id"] if r["custom_id"] is not None else f"line{r['error']['line']}"
        assert key not in recs, f"{p}:{n}: {key} appears twice"
        recs[key] = r
    return recs
a, b = load(ref), load(out)
n_in = sum(1 for l in open(inp) if l.strip())
assert len(a) == n_in, f"the reference has {len(a)} records for {n_in} requests"
assert a.keys() == b.keys(), \
    f"missing {sorted(a.keys() - b.keys())[:5]}, extra {sorted(b.keys() - a.keys())[:5]}"
diff = [k for k in a if a[k] != b[k]]
assert not diff, f"{len(diff)} records differ, e.g. {a[diff[0]]} vs {b[diff[0]]}"
print(len(b))
PY
); then
  ok "every one of $msg custom_ids exactly once, all equal to the uninterrupted run"
else
  bad "output check: $msg"
fi
torn=$(grep -c "torn last line" "$tmp/job.log")
echo "# soak: $kills kills survived, $N requests checked, $torn torn records cut, $(($(date +%s) - t_start)) s wall"
grep -- '^--- run .*killed\|^--- run .*gone' "$tmp/job.log" | sed 's/^/# /'
[ "$fail" -eq 0 ] || { echo "# job log:"; tail -40 "$tmp/job.log"; }
finish
