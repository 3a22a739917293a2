#!/usr/bin/env bash
# test_slurm_cluster.sh FLOTILLA SRC — a real one-node Slurm cluster (issue 5,
# item 2): starts munged, slurmctld and slurmd from Debian's packages with
# everything they need (key, socket, slurm.conf, spool, state, logs, pid
# files) in a temp dir, submits the batch script `flotilla slurm` writes for a
# 2-rank CPU job (srun --mpi=pmix) on the tiny golden llama fixture, waits for
# it, and checks that the two ranks formed one MPI world (rank/size from
# Slurm's PMIx, local rank 1 of 2), that the results equal a 1-rank run, that
# resubmitting resumes with nothing to do, that Slurm's SIGTERM (scancel
# --signal=TERM, as at the time limit) ends a job cleanly and the resubmitted
# script completes it, that one failing rank ends the job, and that
# `srun --mpi=none` fails loudly instead of running two independent copies. Then it cancels what is
# left and stops exactly the daemons it started, by pid.
#
# Why it can skip: the daemons need root, the packages (scripts/setup.sh
# installs them) and a machine that lets them run. When they cannot start the
# test says why and exits 77 (SKIP_RETURN_CODE in tests/CMakeLists.txt);
# FL_SLURM_REQUIRED=1 (and FL_CI=1, which CI sets: scripts/test.sh) turns that into a failure. Once the cluster is up,
# everything is a pass or a failure. Every wait has a deadline; a failure
# prints the tails of the daemons' and the job's logs.
# Prints "N passed, M failed".
set -u
fl=$1
src=$(cd "$2" && pwd)
. "$src/tests/lib.sh"

# A launcher's variables from the caller (a test run inside some Slurm job or
# mpirun) would redirect srun/sbatch and the 1-rank reference run.
for v in $(compgen -e); do
  case $v in SLURM_* | SBATCH_* | SRUN_* | SALLOC_* | PMIX_* | PMI_* | OMPI_COMM_WORLD_*) unset "$v" ;; esac
done
fl_mpi_env

tmp=$(mktemp -d)
declare -A pid=()  # daemon name -> pid (each started here, in the foreground mode, as a child)
jobs_submitted=()

log_tails() {
  local f
  for f in "$tmp"/log/*.log "$tmp"/out/*.log; do
    [ -f "$f" ] || continue
    echo "---- tail of ${f#"$tmp"/}"
    tail -n 25 "$f"
  done
}

skip() {
  echo "SKIP - the Slurm daemons cannot run here: $1"
  log_tails
  if [ "${FL_SLURM_REQUIRED:-0}" = 1 ] || [ "${FL_CI:-0}" = 1 ]; then
    bad "FL_SLURM_REQUIRED=1 or FL_CI=1 and the cluster did not start: $1"
    finish
    exit 1
  fi
  exit 77
}

# Cancels our jobs (their slurmstepd and tasks end with them), then stops the
# daemons by pid: TERM, up to 10 s, then KILL. Idempotent.
stop_all() {
  if [ -n "${pid[slurmctld]:-}" ] && kill -0 "${pid[slurmctld]}" 2>/dev/null && ((${#jobs_submitted[@]})); then
    timeout 10 scancel "${jobs_submitted[@]}" 2>/dev/null
    local end=$((SECONDS + 20))
    while [ $SECONDS -lt $end ] && [ -n "$(timeout 5 squeue -h -o %i 2>/dev/null)" ]; do sleep 0.5; done
  fi
  local name p end
  for name in slurmd slurmctld munged; do
    p=${pid[$name]:-}
    [ -n "$p" ] || continue
    kill -TERM "$p" 2>/dev/null
    end=$((SECONDS + 10))
    while kill -0 "$p" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 0.2; done
    if kill -0 "$p" 2>/dev/null; then
      echo "  $name (pid $p) ignored SIGTERM for 10 s: SIGKILL"
      kill -KILL "$p" 2>/dev/null
    fi
    wait "$p" 2>/dev/null
    unset "pid[$name]"
  done
}
trap 'stop_all; rm -rf "$tmp"' EXIT
trap 'exit 1' INT TERM HUP

# ---- can the daemons run here? --------------------------------------------
[ "$(id -u)" -eq 0 ] || skip "not root (slurmd starts job steps as their users; run as root, as CI does)"
for c in munged munge unmunge slurmctld slurmd sbatch srun squeue scontrol scancel sinfo python3; do
  command -v "$c" >/dev/null 2>&1 || skip "no '$c' (scripts/setup.sh installs slurmctld slurmd slurm-client munge)"
done
host=$(hostname -s 2>/dev/null)
[ -n "$host" ] || skip "hostname -s gives no name for slurm.conf"
# munged wants its socket's folder reachable by all, and nothing writable by others
chmod 711 "$tmp"
mkdir -p "$tmp/munge" "$tmp/log" "$tmp/state" "$tmp/spool" "$tmp/out" "$tmp/model"
chmod 755 "$tmp/munge"
head -c 1024 /dev/urandom >"$tmp/munge/munge.key"
chmod 600 "$tmp/munge/munge.key"
sock=$tmp/munge/munge.sock

munged -F --socket="$sock" --key-file="$tmp/munge/munge.key" --pid-file="$tmp/munge/munged.pid" \
  --log-file="$tmp/log/munged.log" --seed-file="$tmp/munge/munged.seed" >>"$tmp/log/munged.log" 2>&1 &
pid[munged]=$!
end=$((SECONDS + 10))
until timeout 5 munge -S "$sock" -n 2>/dev/null | timeout 5 unmunge -S "$sock" >/dev/null 2>&1; do
  kill -0 "${pid[munged]}" 2>/dev/null || skip "munged exited (see its log below)"
  [ $SECONDS -lt $end ] || skip "munged did not answer on $sock within 10 s"
  sleep 0.2
done

# two free TCP ports for slurmctld and slurmd (several test runs may share a host)
read -r port_ctld port_d < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')
export SLURM_CONF=$tmp/slurm.conf
: >"$tmp/plugstack.conf"
cat >"$SLURM_CONF" <<EOF
# one node, no cgroups, no accounting: what a CI machine without systemd allows
ClusterName=flotilla-ci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port_ctld
SlurmdPort=$port_d
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
PlugStackConfig=$tmp/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# the node is declared with 2 CPUs whatever the machine has
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
MessageTimeout=10
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$host NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
timeout 10 srun --mpi=list 2>&1 | grep -qw pmix ||
  skip "Slurm has no pmix MPI plug-in (srun --mpi=list: $(timeout 10 srun --mpi=list 2>&1 | tr '\n' ' '))"

slurmctld -D -i -f "$SLURM_CONF" >>"$tmp/log/slurmctld.log" 2>&1 &
pid[slurmctld]=$!
slurmd -D -N "$host" -f "$SLURM_CONF" >>"$tmp/log/slurmd.log" 2>&1 &
pid[slurmd]=$!
end=$((SECONDS + 40))
until [ "$(timeout 5 sinfo -h -n "$host" -o %T 2>/dev/null)" = idle ]; do
  for d in slurmctld slurmd; do kill -0 "${pid[$d]}" 2>/dev/null || skip "$d exited (see its log below)"; done
  [ $SECONDS -lt $end ] || skip "node $host not idle within 40 s (sinfo: $(timeout 5 sinfo -h -o '%T %E' 2>&1))"
  sleep 0.5
done
ok "munged, slurmctld and slurmd up (pids ${pid[munged]} ${pid[slurmctld]} ${pid[slurmd]}), node $host idle"
# Every wait below is bounded by its own limit and by what is left of 150 s,
# so the whole test ends well within ctest's TIMEOUT (240 s) and its cleanup runs.
budget_end=$((SECONDS + 150))
within() { # prints min($1, seconds left, at least 1)
  local r=$((budget_end - SECONDS))
  [ $r -ge 1 ] || r=1
  echo $(($1 < r ? $1 : r))
}

# ---- the fixture: golden llama (8 heads, 2 KV heads: tp 2 divides it) plus
# a byte-level BPE tokenizer.json of its 311 ids, all printable ASCII, so the
# generated text shows every token
for f in config.json model.safetensors generation_config.json; do ln -s "$src/tests/golden/llama/$f" "$tmp/model/$f"; done
python3 - "$tmp/model/tokenizer.json" 311 <<'PY'
import json, sys
path, V = sys.argv[1], int(sys.argv[2])
# GPT-2's byte -> printable character map (ByteLevel); printable ASCII maps to itself, space to "Ġ"
bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
cs, n = bs[:], 0
for b in range(256):
    if b not in bs:
        bs.append(b); cs.append(256 + n); n += 1
b2u = dict(zip(bs, map(chr, cs)))
vocab = {b2u[b]: i for i, b in enumerate(range(0x20, 0x7F))}
merges = []
for w in ("Ġ" + a + b + c for a in "etaoinshrd" for b in "etaoinshrd" for c in "xyz"):
    toks = list(w)
    while len(toks) > 1 and len(vocab) < V:
        if toks[0] + toks[1] not in vocab:
            merges.append(toks[0] + " " + toks[1]); vocab[toks[0] + toks[1]] = len(vocab)
        toks = [toks[0] + toks[1]] + toks[2:]
assert len(vocab) == V, len(vocab)
json.dump({"version": "1.0", "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
           "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": False, "vocab": vocab, "merges": merges}}, open(path, "w"))
PY
for i in 1 2 3 4 5 6; do
  echo "{\"custom_id\": \"s$i\", \"body\": {\"prompt\": \"the tax of $i rats\", \"max_tokens\": $((8 + i))}}"
done >"$tmp/req.jsonl"
if timeout "$(within 60)" "$fl" generate --output-format compact --model "$tmp/model" --input "$tmp/req.jsonl" --output "$tmp/one.jsonl" --backend cpu \
     >"$tmp/log/one.log" 2>&1 && [ "$(grep -c '"finish_reason"' "$tmp/one.jsonl")" -eq 6 ]; then
  ok "1-rank reference run: 6 results"
else
  bad "1-rank reference run: $(tail -3 "$tmp/log/one.log")"
fi

# Waits for job $1 to end (deadline $2 s); prints its final JobState and ExitCode.
wait_job() {
  local id=$1 end=$((SECONDS + $(within "$2"))) line state
  if [ "$id" = none ]; then
    echo "NOT_SUBMITTED -"
    return 1
  fi
  while :; do
    line=$(timeout 10 scontrol show job -o "$id" 2>/dev/null)
    state=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$line")
    case $state in
      COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | PREEMPTED | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE)
        echo "$state $(sed -n 's/.* ExitCode=\([0-9:]*\).*/\1/p' <<<"$line")"
        return 0 ;;
    esac
    if [ $SECONDS -ge "$end" ]; then
      echo "TIMEOUT_WAITING ${state:-unknown}"
      return 1
    fi
    sleep 0.5
  done
}

# ---- the 2-rank job, through the script `flotilla slurm` writes -----------
"$fl" slurm --model "$tmp/model" --input "$tmp/req.jsonl" --output "$tmp/out/two.jsonl" --gpus-per-node 0 \
  --tasks-per-node 2 --cpus-per-task 1 --partition ci --time 5 --job-name fl-ci --log "$tmp/out/job-%j.log" \
  -- --verbose --output-format compact >"$tmp/job.sbatch" 2>"$tmp/log/slurm-cmd.log"
if [ $? -eq 0 ] && grep -qxF "#SBATCH --ntasks-per-node=2" "$tmp/job.sbatch" && ! grep -q "^#SBATCH --gpus" "$tmp/job.sbatch" &&
   grep -q -- "--backend cpu" "$tmp/job.sbatch"; then
  ok "flotilla slurm --gpus-per-node 0 --tasks-per-node 2: a CPU job script (2 tasks, no GPU, --backend cpu)"
else
  bad "flotilla slurm: $(cat "$tmp/log/slurm-cmd.log") $(cat "$tmp/job.sbatch")"
fi
if ! "$fl" slurm --model m --input i --output o --gpus-per-node 4 --tasks-per-node 2 >/dev/null 2>"$tmp/log/refused.log" &&
   grep -q "tasks-per-node 2 differs from --gpus-per-node 4" "$tmp/log/refused.log"; then
  ok "--tasks-per-node other than --gpus-per-node refused (one task per GPU)"
else
  bad "--tasks-per-node 2 with 4 GPUs: $(cat "$tmp/log/refused.log")"
fi
# Submits job.sbatch from $tmp/out with the variables given (NAME=VALUE ...)
# added to the job's environment: sets jid ("none" when sbatch failed).
submit() {
  jid=$(cd "$tmp/out" && env "$@" timeout 20 sbatch --parsable "$tmp/job.sbatch" 2>"$tmp/log/sbatch.log") || {
    echo "  sbatch: $(cat "$tmp/log/sbatch.log")"
    jid=none
    return 1
  }
  jid=${jid%%;*}
  jobs_submitted+=("$jid")
}
# Submits and waits: sets jid, state, ec.
run_job() {
  submit
  read -r state ec <<<"$(wait_job "$jid" 90)"
}
run_job
jlog=$tmp/out/job-$jid.log
if [ "$state" = COMPLETED ] && [ "$ec" = 0:0 ]; then
  ok "job $jid completed (exit 0:0)"
else
  bad "job $jid: state $state exit $ec"
fi
if [ -s "$tmp/out/two.jsonl" ] && [ "$(sort "$tmp/out/two.jsonl")" = "$(sort "$tmp/one.jsonl")" ]; then
  ok "2-rank results equal the 1-rank run ($(wc -l <"$tmp/out/two.jsonl") lines)"
else
  bad "2-rank results differ: $(diff <(sort "$tmp/one.jsonl") <(sort "$tmp/out/two.jsonl" 2>/dev/null) | head -6)"
fi
# one MPI world of 2 (PMIx gave rank and size), tensor-parallel over it
if grep -q "rank 0 of 2: tp 0/2" "$jlog" 2>/dev/null && grep -q "rank 1 of 2: tp 1/2" "$jlog"; then
  ok "the ranks formed one world through srun --mpi=pmix (rank 0/1 of 2, tp 2)"
else
  bad "no 'rank R of 2' lines in the job log: $(tail -5 "$jlog" 2>&1)"
fi
if grep -q "local rank 1 of 2" "$jlog" 2>/dev/null && grep -q "local rank 0 of 2" "$jlog"; then
  ok "local ranks 0 and 1 of 2 on the node"
else
  bad "local ranks: $(grep 'local rank' "$jlog" 2>&1)"
fi
if grep -q "done: 6 requests (6 ok" "$jlog" 2>/dev/null && [ -s "$tmp/out/two.jsonl.summary.json" ]; then
  ok "summary on rank 0: 6 requests ok, summary JSON written"
else
  bad "summary: $(grep 'done:' "$jlog" 2>&1)"
fi

# ---- resubmitting the same script: nothing left to do ---------------------
cp "$tmp/out/two.jsonl" "$tmp/first.jsonl" 2>/dev/null
run_job
if [ "$state" = COMPLETED ] && grep -q "0 requests to go" "$tmp/out/job-$jid.log" 2>/dev/null &&
   cmp -s "$tmp/out/two.jsonl" "$tmp/first.jsonl"; then
  ok "resubmitted job $jid resumes: 0 requests to go, output unchanged"
else
  bad "resubmission $jid: state $state exit $ec: $(tail -3 "$tmp/out/job-$jid.log" 2>&1)"
fi

# ---- Slurm's SIGTERM (preemption, --signal before the time limit) ---------
# scancel --signal=TERM reaches every task of the step, as at the time limit:
# the ranks finish what is in flight and exit 0, the job is COMPLETED with
# part of the output, and the resubmitted script does the rest. One sequence
# at a time keeps the in-flight window small; sanitized builds are ~50x slower.
ns=300
ldd "$fl" 2>/dev/null | grep -Eq 'lib(a|ub)san' && ns=24
for ((i = 1; i <= ns; i++)); do
  echo "{\"custom_id\": \"t$i\", \"body\": {\"prompt\": \"the hen of $i rats\", \"max_tokens\": $((10 + i % 20))}}"
done >"$tmp/sig.jsonl"
timeout "$(within 60)" "$fl" generate --output-format compact --model "$tmp/model" --input "$tmp/sig.jsonl" --output "$tmp/sig-one.jsonl" --backend cpu \
  --max-num-seqs 1 >"$tmp/log/sig-one.log" 2>&1 || bad "1-rank reference of the signal job: $(tail -2 "$tmp/log/sig-one.log")"
"$fl" slurm --model "$tmp/model" --input "$tmp/sig.jsonl" --output "$tmp/out/sig.jsonl" --gpus-per-node 0 \
  --tasks-per-node 2 --cpus-per-task 1 --log "$tmp/out/job-%j.log" -- --max-num-seqs 1 --output-format compact >"$tmp/job.sbatch"
submit
end=$((SECONDS + $(within 60)))
until [ -s "$tmp/out/sig.jsonl" ] || [ $SECONDS -ge $end ] || [ -z "$(timeout 5 squeue -h -j "$jid" 2>/dev/null)" ]; do
  sleep 0.05
done
timeout 10 scancel --signal=TERM "$jid"
read -r state ec <<<"$(wait_job "$jid" 90)"
got=$(cat "$tmp/out/sig.jsonl" 2>/dev/null | wc -l)
if [ "$state" = COMPLETED ] && [ "$ec" = 0:0 ] && grep -q "interrupted:" "$tmp/out/job-$jid.log" &&
   [ "$got" -gt 0 ] && [ "$got" -lt "$ns" ]; then
  ok "SIGTERM from scancel: job $jid COMPLETED 0:0 after $got of $ns results"
else
  bad "SIGTERM job $jid: state $state exit $ec, $got of $ns results: $(tail -3 "$tmp/out/job-$jid.log" 2>&1)"
fi
run_job
if [ "$state" = COMPLETED ] && grep -q "$got results already written, $((ns - got)) requests to go" "$tmp/out/job-$jid.log" &&
   [ "$(sort "$tmp/out/sig.jsonl")" = "$(sort "$tmp/sig-one.jsonl")" ]; then
  ok "resubmitted: $((ns - got)) requests to go, then all $ns results equal the 1-rank run"
else
  bad "resuming the signalled job ($jid, $state): $(grep -h 'to go' "$tmp/out/job-$jid.log" 2>&1) $(sort "$tmp/out/sig.jsonl" | uniq -d | head -2)"
fi

# ---- one rank failing ends the job (MPI_Abort, --kill-on-bad-exit) --------
"$fl" slurm --model "$tmp/model" --input "$tmp/req.jsonl" --output "$tmp/out/fail.jsonl" --gpus-per-node 0 \
  --tasks-per-node 2 --cpus-per-task 1 --log "$tmp/out/job-%j.log" >"$tmp/job.sbatch"
t0=$SECONDS
submit FL_TEST_FAIL_RANK=1
read -r state ec <<<"$(wait_job "$jid" 60)"
if [ "$state" = FAILED ] && [ "$ec" != 0:0 ] &&
   [ "$(grep -c "injected failure on rank 1" "$tmp/out/job-$jid.log" 2>/dev/null)" -eq 1 ]; then
  ok "rank 1 failing ends job $jid: FAILED $ec in $((SECONDS - t0)) s, its message once"
else
  bad "failing rank, job $jid: state $state exit $ec: $(grep -c "injected failure" "$tmp/out/job-$jid.log" 2>&1) messages"
fi

# ---- srun without PMIx: every task fails in MPI_Init, nothing is written ----
timeout "$(within 60)" srun -n 2 --mpi=none --kill-on-bad-exit=1 "$fl" generate --output-format compact --model "$tmp/model" --input "$tmp/req.jsonl" \
  --output "$tmp/out/none.jsonl" --backend cpu >"$tmp/log/mpi-none.log" 2>&1
rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ ! -s "$tmp/out/none.jsonl" ]; then
  ok "srun --mpi=none with 2 tasks fails (rc $rc) instead of running 2 copies"
else
  bad "srun --mpi=none (rc $rc): $(tail -3 "$tmp/log/mpi-none.log") $(head -2 "$tmp/out/none.jsonl" 2>&1)"
fi
# one task without PMI is a plain process
if timeout "$(within 60)" srun -n 1 --mpi=none "$fl" generate --output-format compact --model "$tmp/model" --input "$tmp/req.jsonl" \
     --output "$tmp/out/single.jsonl" --backend cpu >"$tmp/log/single.log" 2>&1 &&
   cmp -s <(sort "$tmp/out/single.jsonl") <(sort "$tmp/one.jsonl"); then
  ok "srun -n 1 --mpi=none runs as one plain process, same results"
else
  bad "srun -n 1: $(tail -3 "$tmp/log/single.log")"
fi

# ---- shut down what we started ---------------------------------------------
# (the allocations srun made may still be COMPLETING for a moment)
end=$((SECONDS + $(within 20)))
while left=$(timeout 5 squeue -h -o '%i %T' 2>&1) && [ -n "$left" ] && [ $SECONDS -lt $end ]; do sleep 0.2; done
started="${pid[munged]} ${pid[slurmctld]} ${pid[slurmd]}"
stop_all
alive=""
for p in $started; do kill -0 "$p" 2>/dev/null && alive="$alive $p"; done
if [ -z "$left" ] && [ -z "$alive" ]; then
  ok "no jobs left; daemons stopped by pid ($started)"
else
  bad "jobs left: '$left'; daemons still alive:$alive"
fi
[ "$fail" -eq 0 ] || log_tails
finish
