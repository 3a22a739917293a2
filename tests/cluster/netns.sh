# netns.sh — a cluster of N hosts on one machine, for the multi-node tests
# (sourced, never run). Each host is a Linux network namespace fl-nodeI with
# its own address 10.77.0.I/24 on one link (N = 2: a veth pair; more: every
# host's veth on a bridge in a switch namespace), loopback up, and a hosts
# file (/etc/netns/fl-nodeI/hosts) naming every host. Processes started with
# fl_netns_exec see that file as /etc/hosts and get a UTS namespace of their
# own whose hostname is the host's name, so gethostname(), Open MPI and Slurm
# see N different machines. The file system (and so /tmp, the model, the
# output) is shared, as on a cluster with a shared file system.
#
#   fl_netns_up N       creates the hosts (returns 77 with the reason in
#                       $fl_netns_why where namespaces cannot be made here)
#   fl_netns_exec H CMD runs CMD on host H (fl-node1 ...)
#   fl_netns_down       kills every process in the hosts (TERM, then KILL
#                       after 5 s), deletes the namespaces and the files;
#                       idempotent, safe in an EXIT trap
#
# The names are fixed (fl-node1 ...), so two users of this library must not
# run at once: tests/CMakeLists.txt gives the cluster tests one
# RESOURCE_LOCK. Namespaces of those names left by a run that was killed
# (its pid, in /run/fl-netns/NAME.owner, gone) are removed with what runs in
# them; while their owner lives, fl_netns_up refuses.
FL_NETNS_SUBNET=10.77.0
fl_netns_hosts=()   # the namespaces made here, in order
fl_netns_switch=""  # the bridge's namespace, when there is one
fl_netns_why=""

# Adds the loopback and the given namespace; 77 when the kernel refuses.
fl_netns__add() {
  local err
  if ! err=$(ip netns add "$1" 2>&1); then
    fl_netns_why="cannot create network namespace $1 (needs root with CAP_SYS_ADMIN and a kernel with network namespaces): $err"
    return 77
  fi
  mkdir -p "/etc/netns/$1" /run/fl-netns && echo $$ >"/run/fl-netns/$1.owner"
  ip -n "$1" link set lo up
}

# Removes a namespace called $1 left by an earlier run (killed before its
# cleanup ran), with whatever still runs in it, unless the run that made it
# (its pid in /run/fl-netns/$1.owner) is alive.
fl_netns__stale() {
  local owner p end
  [ -e "/run/netns/$1" ] || { rm -rf "/etc/netns/$1"; return 0; }
  owner=$(cat "/run/fl-netns/$1.owner" 2>/dev/null)
  if [ -n "$owner" ] && [ "$owner" != $$ ] && kill -0 "$owner" 2>/dev/null; then
    fl_netns_why="network namespace $1 belongs to a running process ($owner: another cluster test?): not touching it"
    return 1
  fi
  echo "# removing network namespace $1 left by an earlier run${owner:+ (pid $owner)}"
  for p in $(ip netns pids "$1" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  end=$((SECONDS + 5))
  while [ -n "$(ip netns pids "$1" 2>/dev/null)" ] && [ $SECONDS -lt $end ]; do sleep 0.1; done
  ip netns del "$1"
  rm -rf "/etc/netns/$1" "/run/fl-netns/$1.owner"
}

fl_netns_up() {
  local n=$1 i h a b
  [ "$n" -ge 2 ] || { fl_netns_why="fl_netns_up: N must be at least 2"; return 1; }
  command -v ip >/dev/null 2>&1 || { fl_netns_why="no 'ip' command (iproute2)"; return 77; }
  command -v unshare >/dev/null 2>&1 && command -v nsenter >/dev/null 2>&1 ||
    { fl_netns_why="no 'unshare'/'nsenter' command (util-linux)"; return 77; }
  [ "$(id -u)" -eq 0 ] || { fl_netns_why="not root: creating network namespaces needs CAP_SYS_ADMIN"; return 77; }
  for h in /run/netns/fl-node* /run/netns/fl-switch; do
    [ -e "$h" ] || continue
    fl_netns__stale "${h##*/}" || return 1
  done
  for ((i = 1; i <= n; i++)); do
    h=fl-node$i
    fl_netns__add "$h" || return
    fl_netns_hosts+=("$h")
  done
  if [ "$n" -gt 2 ]; then
    fl_netns__add fl-switch || return
    fl_netns_switch=fl-switch
    ip -n fl-switch link add br0 type bridge && ip -n fl-switch link set br0 up || return 1
  fi
  # veth ends get unique names in the root namespace (other runs, other
  # tests), then are moved and renamed eth0 / pI.
  for ((i = 1; i <= n; i++)); do
    h=fl-node$i
    a=flv$$h$i b=flv$$p$i
    if [ "$n" -le 2 ]; then
      [ "$i" -eq 1 ] || continue
      ip link add "$a" type veth peer name "$b" || return 1
      ip link set "$a" netns fl-node1 && ip link set "$b" netns fl-node2 || return 1
      ip -n fl-node2 link set "$b" name eth0 || return 1
    else
      ip link add "$a" type veth peer name "$b" || return 1
      ip link set "$a" netns "$h" && ip link set "$b" netns fl-switch || return 1
      ip -n fl-switch link set "$b" name "p$i" && ip -n fl-switch link set "p$i" master br0 &&
        ip -n fl-switch link set "p$i" up || return 1
    fi
    ip -n "$h" link set "$a" name eth0 || return 1
  done
  for ((i = 1; i <= n; i++)); do
    h=fl-node$i
    ip -n "$h" addr add "$FL_NETNS_SUBNET.$i/24" dev eth0 && ip -n "$h" link set eth0 up || return 1
    {
      echo "127.0.0.1 localhost"
      for ((j = 1; j <= n; j++)); do echo "$FL_NETNS_SUBNET.$j fl-node$j"; done
    } >"/etc/netns/$h/hosts"
  done
  # the link is up once host 1 reaches every other host over TCP (bounded)
  for ((i = 2; i <= n; i++)); do
    fl_netns_exec fl-node1 timeout 10 python3 - "fl-node$i" <<'PY' || { fl_netns_why="fl-node1 cannot reach fl-node$i"; return 1; }
import socket, sys, time
end = time.time() + 8
while True:
    try:
        socket.create_connection((sys.argv[1], 9), timeout=1).close(); break
    except ConnectionRefusedError:
        break  # the host answered (nothing listens on port 9)
    except OSError:
        if time.time() > end: sys.exit(1)
        time.sleep(0.1)
PY
  done
}

# Not `ip netns exec`: that remounts /sys for the namespace, which hides
# /sys/fs/cgroup (slurmd will not start without it). Instead the network
# namespace is entered, and a private mount namespace gets the host's hosts
# file bound over /etc/hosts.
fl_netns_exec() {
  local h=$1
  shift
  nsenter --net="/run/netns/$h" unshare --uts --mount --propagation private /bin/sh -c \
    'mount --bind "/etc/netns/$0/hosts" /etc/hosts && hostname "$0" && exec "$@"' "$h" "$@"
}

fl_netns_down() {
  local h p end left
  for h in "${fl_netns_hosts[@]}" $fl_netns_switch; do
    for p in $(ip netns pids "$h" 2>/dev/null); do kill -TERM "$p" 2>/dev/null; done
  done
  end=$((SECONDS + 5))
  while :; do
    left=""
    for h in "${fl_netns_hosts[@]}" $fl_netns_switch; do left+=$(ip netns pids "$h" 2>/dev/null); done
    [ -n "$left" ] && [ $SECONDS -lt $end ] || break
    sleep 0.2
  done
  for h in "${fl_netns_hosts[@]}" $fl_netns_switch; do
    for p in $(ip netns pids "$h" 2>/dev/null); do
      echo "# pid $p in $h ignored SIGTERM for 5 s: SIGKILL"
      kill -KILL "$p" 2>/dev/null
    done
  done
  for h in "${fl_netns_hosts[@]}" $fl_netns_switch; do
    ip netns del "$h" 2>/dev/null
    rm -rf "/etc/netns/$h" "/run/fl-netns/$h.owner"
  done
  rmdir /run/fl-netns 2>/dev/null
  rmdir /etc/netns 2>/dev/null  # only when empty: ip netns makes it again when needed
  fl_netns_hosts=()
  fl_netns_switch=""
  return 0
}
