#!/usr/bin/env bash
# test_cluster_mpi.sh FLOTILLA SRC — flotilla across two hosts: two network
# namespaces (tests/cluster/netns.sh: fl-node1 10.77.0.1, fl-node2 10.77.0.2
# on a veth pair, each with its own hostname), Open MPI started on fl-node1
# and reaching fl-node2 through tests/cluster/netns_agent.sh in place of ssh
# (a fresh environment, as a login gives), every byte between the hosts on
# TCP over the veth (btl tcp,self; oob and btl restricted to 10.77.0.0/24).
# On the CPU backend and the golden llama fixture (8 heads, 2 KV heads) with a
# byte tokenizer it checks that
#   - tp 2 on one rank per host gives the greedy results of a one-rank run,
#     each rank on its own host (--verbose: host, local rank 0 of 1), with
#     traffic on the veth;
#   - tp 2 x dp 2 on two ranks per host, filled host by host (tp groups
#     within a host) and round-robin (--map-by node: tp groups across hosts),
#     gives the same results, local ranks 0 and 1 of 2 on each host;
#   - a rank failing on the remote host ends the whole job (non-zero exit,
#     its message once) and leaves no process behind on either host.
# Skips (exit 77) only when network namespaces cannot be created here (not
# root, no CAP_SYS_ADMIN); FL_CLUSTER_REQUIRED=1 (and FL_CI=1, which
# scripts/test.sh sets) makes that a failure.
# Prints "N passed, M failed".
set -u
fl=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
src=$(cd "$2" && pwd)
. "$src/tests/lib.sh"
. "$src/tests/cluster/netns.sh"

# a caller's launcher variables would redirect mpirun and the reference run
for v in $(compgen -e); do
  case $v in SLURM_* | PMIX_* | PMI_* | OMPI_COMM_WORLD_* | OMPI_MCA_*) unset "$v" ;; esac
done
fl_mpi_env

tmp=$(mktemp -d)
chmod 755 "$tmp"
trap 'fl_netns_down; rm -rf "$tmp"' EXIT
trap 'exit 1' INT TERM HUP

command -v mpirun >/dev/null 2>&1 || { bad "no mpirun (scripts/setup.sh installs Open MPI)"; finish; exit 1; }
fl_netns_up 2
rc=$?
if [ $rc -eq 77 ]; then
  echo "SKIP - two hosts cannot be made on this machine: $fl_netns_why"
  if [ "${FL_CLUSTER_REQUIRED:-0}" = 1 ] || [ "${FL_CI:-0}" = 1 ]; then bad "FL_CLUSTER_REQUIRED=1 or FL_CI=1: $fl_netns_why"; finish; exit 1; fi
  exit 77
elif [ $rc -ne 0 ]; then
  bad "building the two hosts: $fl_netns_why"
  finish
  exit 1
fi
ok "hosts fl-node1 (10.77.0.1) and fl-node2 (10.77.0.2) up: $(ip netns list | grep -c '^fl-node') namespaces, TCP between them"

# sanitized builds run the model ~50x slower: fewer, shorter requests
sanitized=0
ldd "$fl" 2>/dev/null | grep -Eq 'lib(a|ub)san' && sanitized=1
[ $sanitized = 1 ] && N=6 || N=16
fl_byte_model "$src" llama "$tmp/model" || { bad "byte tokenizer for the llama fixture"; finish; exit 1; }
for ((i = 1; i <= N; i++)); do
  echo "{\"custom_id\": \"c$i\", \"body\": {\"prompt\": \"the host $i said\", \"max_tokens\": $((4 + i % 5))}}"
done >"$tmp/req.jsonl"

t0=$SECONDS
if timeout 120 "$fl" generate --output-format compact --model "$tmp/model" --input "$tmp/req.jsonl" --output "$tmp/one.jsonl" \
     --backend cpu >"$tmp/one.log" 2>&1 && [ "$(grep -c '"finish_reason"' "$tmp/one.jsonl")" -eq "$N" ]; then
  ok "one-rank reference: $N results in $((SECONDS - t0)) s"
else
  bad "one-rank reference: $(tail -3 "$tmp/one.log")"
fi

# mpirun on fl-node1; ranks and daemons reach fl-node2 only through the
# agent and only over the veth. Everything a rank needs is passed with -x,
# as between real machines (the agent gives the remote side a bare
# environment).
mpi=(mpirun --mca plm_rsh_agent "$src/tests/cluster/netns_agent.sh" --mca plm_rsh_no_tree_spawn 1
  --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24
  --mca rmaps_base_oversubscribe 1 --mca mpi_yield_when_idle 1 --bind-to none
  -x OMP_NUM_THREADS -x ASAN_OPTIONS -x HWLOC_COMPONENTS=-pci)

# bytes through fl-node2's end of the link, both ways
veth_bytes() {
  ip netns exec fl-node2 cat /sys/class/net/eth0/statistics/rx_bytes /sys/class/net/eth0/statistics/tx_bytes |
    awk '{s += $1} END {print s}'
}

# run NAME HOSTS NP [mpirun options --] generate options...: the job from
# fl-node1 into $tmp/NAME.jsonl, its log in $tmp/NAME.log; sets rc and took
run() {
  local name=$1 hosts=$2 np=$3
  shift 3
  local pre=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do pre+=("$1"); shift; done
  shift
  local t=$SECONDS
  fl_netns_exec fl-node1 timeout 150 "${mpi[@]}" "${pre[@]}" --host "$hosts" -np "$np" \
    "$fl" generate --output-format compact --model "$tmp/model" --input "$tmp/req.jsonl" --output "$tmp/$name.jsonl" \
    --backend cpu --verbose "$@" >"$tmp/$name.log" 2>&1
  rc=$?
  took=$((SECONDS - t))
}

# same_results NAME: the job's results are the one-rank run's
same_results() {
  [ -s "$tmp/$1.jsonl" ] && [ "$(sort "$tmp/$1.jsonl")" = "$(sort "$tmp/one.jsonl")" ]
}

# ---- tp 2: one rank per host ------------------------------------------------
b0=$(veth_bytes)
run tp2 fl-node1:1,fl-node2:1 2 -- --tp 2
b1=$(veth_bytes)
if [ $rc -eq 0 ] && same_results tp2; then
  ok "tp 2 across fl-node1 and fl-node2: exit 0 in $took s, $N results equal the one-rank run"
else
  bad "tp 2 across two hosts (rc $rc): $(tail -5 "$tmp/tp2.log") $(diff <(sort "$tmp/one.jsonl") <(sort "$tmp/tp2.jsonl" 2>/dev/null) | head -4)"
fi
if grep -q "rank 0 of 2: tp 0/2, dp 0/1, ep 0/1, host fl-node1$" "$tmp/tp2.log" &&
   grep -q "rank 1 of 2: tp 1/2, dp 0/1, ep 0/1, host fl-node2$" "$tmp/tp2.log"; then
  ok "rank 0 reports host fl-node1, rank 1 host fl-node2 (tp 0/2 and 1/2)"
else
  bad "hosts of the tp 2 ranks: $(grep 'of 2: tp' "$tmp/tp2.log")"
fi
if [ "$(grep -c "flotilla: rank [01]: bound to .*(local rank 0 of 1:" "$tmp/tp2.log")" -eq 2 ]; then
  ok "each host sees one local rank (local rank 0 of 1 on both)"
else
  bad "local ranks of the tp 2 job: $(grep 'local rank' "$tmp/tp2.log")"
fi
if [ $((b1 - b0)) -gt 20000 ]; then
  ok "the tp 2 job moved $((b1 - b0)) bytes over the veth between the hosts"
else
  bad "only $((b1 - b0)) bytes on fl-node2's link during the tp 2 job"
fi

# ---- tp 2 x dp 2: two ranks per host ---------------------------------------
# host by host: ranks 0,1 on fl-node1 and 2,3 on fl-node2 (tp within a host)
run tp2dp2 fl-node1:2,fl-node2:2 4 --map-by slot -- --tp 2 --dp 2
if [ $rc -eq 0 ] && same_results tp2dp2; then
  ok "tp 2 x dp 2 on 2 x 2 ranks (by host): exit 0 in $took s, results equal the one-rank run"
else
  bad "tp 2 x dp 2 by host (rc $rc): $(tail -5 "$tmp/tp2dp2.log")"
fi
lay_ok=1
for r in 0 1 2 3; do
  h=fl-node$((r / 2 + 1))
  grep -q "rank $r of 4: tp $((r % 2))/2, dp $((r / 2))/2, ep 0/1, host $h$" "$tmp/tp2dp2.log" || lay_ok=0
  grep -q "flotilla: rank $r: bound to .*(local rank $((r % 2)) of 2:" "$tmp/tp2dp2.log" || lay_ok=0
done
if [ $lay_ok = 1 ]; then
  ok "by host: ranks 0,1 on fl-node1 and 2,3 on fl-node2, local ranks 0 and 1 of 2 on each, tp groups within a host"
else
  bad "layout by host: $(grep -E 'of 4: tp|local rank' "$tmp/tp2dp2.log")"
fi
# round-robin: ranks 0,2 on fl-node1 and 1,3 on fl-node2 (tp groups across hosts)
run rr fl-node1:2,fl-node2:2 4 --map-by node -- --tp 2 --dp 2
if [ $rc -eq 0 ] && same_results rr; then
  ok "tp 2 x dp 2 round-robin (--map-by node): exit 0 in $took s, results equal the one-rank run"
else
  bad "tp 2 x dp 2 round-robin (rc $rc): $(tail -5 "$tmp/rr.log")"
fi
lay_ok=1
for r in 0 1 2 3; do
  h=fl-node$((r % 2 + 1))
  grep -q "rank $r of 4: tp $((r % 2))/2, dp $((r / 2))/2, ep 0/1, host $h$" "$tmp/rr.log" || lay_ok=0
  grep -q "flotilla: rank $r: bound to .*(local rank $((r / 2)) of 2:" "$tmp/rr.log" || lay_ok=0
done
if [ $lay_ok = 1 ]; then
  ok "round-robin: ranks 0,2 on fl-node1 and 1,3 on fl-node2, each tp group spans both hosts"
else
  bad "layout round-robin: $(grep -E 'of 4: tp|local rank' "$tmp/rr.log")"
fi

# ---- a rank failing on the remote host ends the job -------------------------
run fail fl-node1:1,fl-node2:1 2 -x FL_TEST_FAIL_RANK=1 -- --tp 2
end=$((SECONDS + 15))
left="x"
while [ -n "$left" ] && [ $SECONDS -lt $end ]; do
  left=$(ip netns pids fl-node1; ip netns pids fl-node2)
  [ -n "$left" ] && sleep 0.2
done
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$(grep -c "injected failure on rank 1" "$tmp/fail.log")" -eq 1 ] && [ -z "$left" ]; then
  ok "rank 1 failing on fl-node2 ends the job: exit $rc in $took s, its message once, no process left on either host"
else
  bad "failing remote rank: rc $rc, $(grep -c "injected failure" "$tmp/fail.log") messages, processes left: '$left': $(tail -4 "$tmp/fail.log")"
fi

[ "$fail" -eq 0 ] || for f in "$tmp"/*.log; do echo "---- tail of ${f##*/}"; tail -n 15 "$f"; done
fl_netns_down
if ip netns list | grep -Eq '^fl-(node|switch)' || [ -d /etc/netns/fl-node1 ]; then
  bad "namespaces or files left: $(ip netns list | tr '\n' ' ')"
else
  ok "cleanup: no fl-node namespace or hosts file left"
fi
finish
