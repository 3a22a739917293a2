#!/usr/bin/env bash
# test_cluster_slurm.sh FLOTILLA SRC — a two-node Slurm cluster on one
# machine: hosts fl-node1 and fl-node2 are network namespaces
# (tests/cluster/netns.sh, 10.77.0.1 and .2 on a veth pair, each with its own
# hostname). fl-node1 runs munged and slurmctld, each host runs a slurmd
# (NodeName=fl-node[1-2] in a slurm.conf written here; one munge key and
# socket serve both, as a key copied to every node would). Every Slurm
# client runs on fl-node1. It checks that
#   - `flotilla slurm --nodes 2 --gpus-per-node 0 --submit` puts one rank on
#     each node (srun --mpi=pmix across the hosts, tp 2: --verbose names
#     hosts fl-node1 and fl-node2) and writes every custom_id exactly once,
#     the results those of a one-rank run;
#   - with two tasks per node (tp 2 x dp 2) ranks 0,1 are on fl-node1 and
#     2,3 on fl-node2, local ranks 0 and 1 of 2 on each, same results;
#   - scancel in the middle of a longer job ends it (CANCELLED, part of the
#     output written, every line whole) and submitting the same job again
#     finishes it: every custom_id exactly once, the results equal the
#     one-rank run.
# Cleanup stops every process in the two hosts (daemons, steps, ranks) and
# removes the namespaces and files. Skips (exit 77) where namespaces cannot
# be made or the Slurm/munge packages are missing (scripts/setup.sh installs
# them); FL_CLUSTER_REQUIRED=1 (and FL_CI=1, which scripts/test.sh sets)
# makes a skip a failure.
# Prints "N passed, M failed".
set -u
fl=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
src=$(cd "$2" && pwd)
. "$src/tests/lib.sh"
. "$src/tests/cluster/netns.sh"

for v in $(compgen -e); do
  case $v in SLURM_* | SBATCH_* | SRUN_* | SALLOC_* | PMIX_* | PMI_* | OMPI_COMM_WORLD_* | OMPI_MCA_*) unset "$v" ;; esac
done
fl_mpi_env

tmp=$(mktemp -d)
chmod 711 "$tmp"
trap 'fl_netns_down; rm -rf "$tmp"' EXIT
trap 'exit 1' INT TERM HUP

log_tails() {
  local f
  for f in "$tmp"/log/*.log "$tmp"/out/*.log; do
    [ -f "$f" ] || continue
    echo "---- tail of ${f#"$tmp"/}"
    tail -n 20 "$f"
  done
}
skip() {
  echo "SKIP - a two-node Slurm cluster cannot run here: $1"
  log_tails
  if [ "${FL_CLUSTER_REQUIRED:-0}" = 1 ] || [ "${FL_CI:-0}" = 1 ]; then bad "FL_CLUSTER_REQUIRED=1 or FL_CI=1: $1"; finish; exit 1; fi
  exit 77
}
# on1 CMD...: CMD on fl-node1 (where the Slurm clients reach slurmctld)
on1() { fl_netns_exec fl-node1 "$@"; }

for c in munged munge unmunge slurmctld slurmd sbatch srun squeue scontrol scancel sinfo python3; do
  command -v "$c" >/dev/null 2>&1 || skip "no '$c' (scripts/setup.sh installs slurmctld slurmd slurm-client munge)"
done
fl_netns_up 2
rc=$?
[ $rc -eq 77 ] && skip "$fl_netns_why"
if [ $rc -ne 0 ]; then bad "building the two hosts: $fl_netns_why"; finish; exit 1; fi

mkdir -p "$tmp/munge" "$tmp/log" "$tmp/state" "$tmp/spool" "$tmp/out"
chmod 755 "$tmp/munge"
head -c 1024 /dev/urandom >"$tmp/munge/munge.key"
chmod 600 "$tmp/munge/munge.key"
sock=$tmp/munge/munge.sock
# a path socket: reachable from both network namespaces
on1 munged -F --socket="$sock" --key-file="$tmp/munge/munge.key" --pid-file="$tmp/munge/munged.pid" \
  --log-file="$tmp/log/munged.log" --seed-file="$tmp/munge/munged.seed" >>"$tmp/log/munged.log" 2>&1 &
end=$((SECONDS + 10))
until timeout 5 munge -S "$sock" -n 2>/dev/null | fl_netns_exec fl-node2 timeout 5 unmunge -S "$sock" >/dev/null 2>&1; do
  [ $SECONDS -lt $end ] || skip "munged did not answer on $sock within 10 s"
  sleep 0.2
done

# Each daemon is in its own network namespace, so the usual ports serve.
export SLURM_CONF=$tmp/slurm.conf
: >"$tmp/plugstack.conf"
cat >"$SLURM_CONF" <<EOF
# two nodes, no cgroups, no accounting: what a CI machine without systemd allows
ClusterName=flotilla-2n
SlurmctldHost=fl-node1(10.77.0.1)
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool/%n
# each node's own scratch (PMIx's per-step folders; the hosts share /tmp)
TmpFS=$tmp/nodetmp/%n
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd-%n.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd-%n.log
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
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
MessageTimeout=10
# a node that stops answering is declared down (and its jobs NODE_FAIL)
# after 5 s, not the default 300 (the node-loss check below)
SlurmdTimeout=5
KillWait=10
SlurmctldDebug=info
SlurmdDebug=info
NodeName=fl-node[1-2] NodeAddr=10.77.0.[1-2] CPUs=2 State=UNKNOWN
PartitionName=ci Nodes=fl-node[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
timeout 10 srun --mpi=list 2>&1 | grep -qw pmix ||
  skip "Slurm has no pmix MPI plug-in (srun --mpi=list: $(timeout 10 srun --mpi=list 2>&1 | tr '\n' ' '))"
on1 slurmctld -D -i -f "$SLURM_CONF" >>"$tmp/log/slurmctld.log" 2>&1 &
for h in fl-node1 fl-node2; do
  mkdir -p "$tmp/spool/$h" "$tmp/nodetmp/$h"
  fl_netns_exec "$h" slurmd -D -N "$h" -f "$SLURM_CONF" >>"$tmp/log/slurmd-$h.log" 2>&1 &
done
end=$((SECONDS + 40))
until [ "$(on1 timeout 5 sinfo -h -o '%n %T' 2>/dev/null | sort | tr '\n' ' ')" = "fl-node1 idle fl-node2 idle " ]; do
  [ $SECONDS -lt $end ] || skip "nodes not idle within 40 s (sinfo: $(on1 timeout 5 sinfo -h -o '%n %T %E' 2>&1 | tr '\n' ' '))"
  sleep 0.5
done
ok "munged and slurmctld on fl-node1, a slurmd on each host: fl-node1 and fl-node2 idle"
# every wait below is bounded by its own limit and what is left of 200 s
budget_end=$((SECONDS + 300))
within() {
  local r=$((budget_end - SECONDS))
  [ $r -ge 1 ] || r=1
  echo $(($1 < r ? $1 : r))
}

fl_byte_model "$src" llama "$tmp/model" >/dev/null || { bad "byte tokenizer for the llama fixture"; finish; exit 1; }
sanitized=0
ldd "$fl" 2>/dev/null | grep -Eq 'lib(a|ub)san' && sanitized=1
N=8
for ((i = 1; i <= N; i++)); do
  echo "{\"custom_id\": \"a$i\", \"body\": {\"prompt\": \"node $i of two\", \"max_tokens\": $((5 + i % 4))}}"
done >"$tmp/req.jsonl"
# the scancel job: long enough that the cancel lands in the middle
[ $sanitized = 1 ] && NS=40 || NS=400
for ((i = 1; i <= NS; i++)); do
  echo "{\"custom_id\": \"b$i\", \"body\": {\"prompt\": \"the job $i ran\", \"max_tokens\": $((10 + i % 20))}}"
done >"$tmp/long.jsonl"
for r in req long; do
  timeout "$(within 90)" "$fl" generate --output-format compact --model "$tmp/model" --input "$tmp/$r.jsonl" \
    --output "$tmp/$r-one.jsonl" --backend cpu --max-num-seqs 1 >"$tmp/log/$r-one.log" 2>&1 ||
    bad "one-rank reference of $r.jsonl: $(tail -3 "$tmp/log/$r-one.log")"
done

# ids FILE INPUT: every line whole JSON, each custom_id of INPUT at most once;
# prints how many
ids() {
  python3 - "$1" "$2" <<'PY'
import json, sys
raw = open(sys.argv[1], "rb").read() if __import__("os").path.exists(sys.argv[1]) else b""
assert raw == b"" or raw.endswith(b"\n"), "last line not terminated"
ids = [json.loads(l)["custom_id"] for l in raw.decode().splitlines()]
want = {json.loads(l)["custom_id"] for l in open(sys.argv[2])}
assert len(ids) == len(set(ids)), "a custom_id twice"
assert set(ids) <= want, "an id not in the input"
print(len(ids))
PY
}

# Waits for job $1 (deadline $2 s); prints its final JobState and ExitCode.
# job_over ID: the job is in a final state (a failed query is not one)
job_over() {
  on1 timeout 5 scontrol show job -o "$1" 2>/dev/null |
    grep -Eq 'JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|PREEMPTED|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE)'
}
wait_job() {
  local id=$1 end=$((SECONDS + $(within "$2"))) line state
  while :; do
    line=$(on1 timeout 10 scontrol show job -o "$id" 2>/dev/null)
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
# submit INPUT OUTPUT [generate options]: `flotilla slurm --nodes 2 --submit`
# from $tmp/out on fl-node1, $tpn tasks per node; sets jid (none when it failed)
tpn=1
submit() {
  local in=$1 out=$2
  shift 2
  local said
  said=$(cd "$tmp/out" && on1 timeout 30 "$fl" slurm --model "$tmp/model" --input "$in" --output "$out" --nodes 2 \
    --gpus-per-node 0 --tasks-per-node "$tpn" --cpus-per-task 1 --partition ci --time 5 --job-name fl-2n \
    --log "$tmp/out/job-%j.log" --submit -- --verbose --output-format compact "$@" 2>"$tmp/log/submit.log")
  jid=$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' <<<"$said")
  [ -n "$jid" ] || { echo "  flotilla slurm --submit: $said $(cat "$tmp/log/submit.log")"; jid=none; }
}

# ---- one rank per node -----------------------------------------------------
submit "$tmp/req.jsonl" "$tmp/out/two.jsonl"
read -r state ec <<<"$(wait_job "$jid" 90)"
jlog=$tmp/out/job-$jid.log
if [ "$state" = COMPLETED ] && [ "$ec" = 0:0 ]; then
  ok "flotilla slurm --nodes 2 --submit: job $jid COMPLETED 0:0"
else
  bad "2-node job $jid: state $state exit $ec"
fi
if n=$(ids "$tmp/out/two.jsonl" "$tmp/req.jsonl" 2>&1) && [ "$n" = "$N" ] &&
   [ "$(sort "$tmp/out/two.jsonl")" = "$(sort "$tmp/req-one.jsonl")" ]; then
  ok "every custom_id exactly once ($N), results equal the one-rank run"
else
  bad "2-node results: $n; $(diff <(sort "$tmp/req-one.jsonl") <(sort "$tmp/out/two.jsonl" 2>/dev/null) | head -4)"
fi
if grep -q "rank 0 of 2: tp 0/2, dp 0/1, ep 0/1, host fl-node1$" "$jlog" 2>/dev/null &&
   grep -q "rank 1 of 2: tp 1/2, dp 0/1, ep 0/1, host fl-node2$" "$jlog" &&
   [ "$(grep -c "bound to .*(local rank 0 of 1:" "$jlog")" -eq 2 ] && grep -q "2 nodes, 2 tasks" "$jlog"; then
  ok "srun --mpi=pmix made one world over both nodes: rank 0 on fl-node1, rank 1 on fl-node2, local rank 0 of 1 each"
else
  bad "ranks of job $jid: $(grep -E 'of 2: tp|local rank|nodes,' "$jlog" 2>&1)"
fi

# ---- tp 2 x dp 2: two tasks per node (SLURM_LOCALID 0 and 1 on each) --------
tpn=2
submit "$tmp/req.jsonl" "$tmp/out/four.jsonl" --tp 2 --dp 2
tpn=1
read -r state ec <<<"$(wait_job "$jid" 90)"
jlog=$tmp/out/job-$jid.log
lay_ok=1
for r in 0 1 2 3; do
  grep -q "rank $r of 4: tp $((r % 2))/2, dp $((r / 2))/2, ep 0/1, host fl-node$((r / 2 + 1))$" "$jlog" 2>/dev/null || lay_ok=0
  grep -q "flotilla: rank $r: bound to .*(local rank $((r % 2)) of 2:" "$jlog" 2>/dev/null || lay_ok=0
done
if [ "$state" = COMPLETED ] && [ $lay_ok = 1 ] && n=$(ids "$tmp/out/four.jsonl" "$tmp/req.jsonl" 2>&1) && [ "$n" = "$N" ] &&
   [ "$(sort "$tmp/out/four.jsonl")" = "$(sort "$tmp/req-one.jsonl")" ]; then
  ok "--tasks-per-node 2, tp 2 x dp 2: job $jid COMPLETED, ranks 0,1 on fl-node1 and 2,3 on fl-node2 (local 0 and 1 of 2), every id once, equal to the one-rank run"
else
  bad "tp 2 x dp 2 job $jid: state $state exit $ec, ids ${n:-?}: $(grep -E 'of 4: tp|local rank' "$jlog" 2>&1)"
fi

# ---- scancel in the middle, then the same job again ------------------------
submit "$tmp/long.jsonl" "$tmp/out/long.jsonl" --max-num-seqs 1
end=$((SECONDS + $(within 60)))
# (the job's end is read from scontrol's state: an empty answer from a
# client that failed under load is not an end)
until [ -s "$tmp/out/long.jsonl" ] || [ $SECONDS -ge $end ] || job_over "$jid"; do
  sleep 0.05
done
on1 timeout 10 scancel "$jid"
read -r state ec <<<"$(wait_job "$jid" 60)"
got=$(ids "$tmp/out/long.jsonl" "$tmp/long.jsonl" 2>&1)
if [ "$state" = CANCELLED ] && [[ $got =~ ^[0-9]+$ ]] && [ "$got" -gt 0 ] && [ "$got" -lt "$NS" ]; then
  ok "scancel mid-job: job $jid CANCELLED after $got of $NS results, every line whole, no id twice"
else
  bad "scancel of job $jid: state $state exit $ec, results: $got"
fi
submit "$tmp/long.jsonl" "$tmp/out/long.jsonl" --max-num-seqs 1
read -r state ec <<<"$(wait_job "$jid" 120)"
n=
if [ "$state" = COMPLETED ] && grep -q "$got results already written, $((NS - got)) requests to go" "$tmp/out/job-$jid.log" &&
   n=$(ids "$tmp/out/long.jsonl" "$tmp/long.jsonl" 2>&1) && [ "$n" = "$NS" ] &&
   [ "$(sort "$tmp/out/long.jsonl")" = "$(sort "$tmp/long-one.jsonl")" ]; then
  ok "resubmitted job $jid finished the rest ($((NS - got)) to go): all $NS custom_ids exactly once, equal to the one-rank run"
else
  bad "resubmission $jid: state $state exit $ec: $(grep -h 'to go' "$tmp/out/job-$jid.log" 2>&1) ids: ${n:-?}"
fi

# ---- a node lost mid-job: fl-node2's slurmd and rank killed, then a resubmission
submit "$tmp/long.jsonl" "$tmp/out/lost.jsonl" --max-num-seqs 1
end=$((SECONDS + $(within 60)))
until [ -s "$tmp/out/lost.jsonl" ] || [ $SECONDS -ge $end ] || [ -z "$(on1 timeout 5 squeue -h -j "$jid" 2>/dev/null)" ]; do
  sleep 0.05
done
for p in $(ip netns pids fl-node2 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
t_kill=$SECONDS
jlog=$tmp/out/job-$jid.log
# Slurm declares the node down (SlurmdTimeout) and cancels the step: the
# ranks left on fl-node1 do not notice a peer that vanished without a word
# (Open MPI leaves that to the launcher), so this is Slurm's message; it
# came after 25 s in every run here (SlurmdTimeout 5, MessageTimeout 10)
lostre="Node failure on fl-node2|CANCELLED AT .* DUE TO NODE FAILURE"
end=$((SECONDS + $(within 45)))
until grep -Eq "$lostre" "$jlog" 2>/dev/null || [ $SECONDS -ge $end ]; do sleep 0.2; done
t_msg=$((SECONDS - t_kill))
lost=$(ids "$tmp/out/lost.jsonl" "$tmp/long.jsonl" 2>&1)
if grep -Eq "$lostre" "$jlog" 2>/dev/null && [ $t_msg -le 45 ] && [[ $lost =~ ^[0-9]+$ ]] && [ "$lost" -lt "$NS" ]; then
  ok "fl-node2 killed mid-job (slurmd and rank): the step cancelled for node failure after $t_msg s, $lost results whole: $(grep -Eom1 "$lostre" "$jlog")"
else
  bad "node loss, job $jid: no node-failure message after $t_msg s, results ${lost:-?}; log: $(tail -5 "$jlog" 2>&1 | tr '\n' ' ')"
fi
# the job may stay COMPLETING while its node is down
on1 timeout 10 scancel "$jid" >/dev/null 2>&1
wait_job "$jid" 30 >/dev/null
# the node comes back (its slurmd again, the node resumed), and the job is submitted again
fl_netns_exec fl-node2 slurmd -D -N fl-node2 -f "$SLURM_CONF" >>"$tmp/log/slurmd-fl-node2.log" 2>&1 &
on1 timeout 10 scontrol update nodename=fl-node2 state=resume >/dev/null 2>&1
end=$((SECONDS + $(within 40)))
until on1 timeout 5 sinfo -h -n fl-node2 -o '%T' 2>/dev/null | grep -qx idle || [ $SECONDS -ge $end ]; do
  on1 timeout 10 scontrol update nodename=fl-node2 state=resume >/dev/null 2>&1
  sleep 0.5
done
submit "$tmp/long.jsonl" "$tmp/out/lost.jsonl" --max-num-seqs 1
read -r state ec <<<"$(wait_job "$jid" 120)"
if [ "$state" = COMPLETED ] && n=$(ids "$tmp/out/lost.jsonl" "$tmp/long.jsonl" 2>&1) && [ "$n" = "$NS" ] &&
   [ "$(sort "$tmp/out/lost.jsonl")" = "$(sort "$tmp/long-one.jsonl")" ]; then
  ok "after the node's return, resubmitted job $jid finished: all $NS custom_ids exactly once, equal to the one-rank run"
else
  bad "resubmission after node loss, job $jid: state $state exit $ec, ids ${n:-?}: $(tail -3 "$tmp/out/job-$jid.log" 2>&1 | tr '\n' ' ')"
fi

# ---- shut down ---------------------------------------------------------------
[ "$fail" -eq 0 ] || log_tails
fl_netns_down
if ip netns list | grep -Eq '^fl-(node|switch)' || [ -d /etc/netns/fl-node1 ]; then
  bad "namespaces or files left: $(ip netns list | tr '\n' ' ')"
else
  ok "cleanup: every daemon and job process stopped, no fl-node namespace or hosts file left"
fi
finish
