#!/bin/sh
# netns_agent.sh HOST COMMAND... — Open MPI's remote launcher (plm_rsh_agent)
# for the namespace hosts of netns.sh: what ssh would do, entering HOST's
# network namespace (and a UTS namespace named HOST) instead of logging in.
# Like ssh, the command words are joined and run by a shell on the "remote"
# side, in a fresh environment (PATH, HOME, USER, LANG only), so whatever the
# ranks need must travel the way it would between machines (mpirun -x).
# Options before the host (ssh-style flags Open MPI may add) are ignored.
while [ $# -gt 0 ]; do
  case $1 in -*) shift ;; *) break ;; esac
done
[ $# -ge 2 ] || { echo "netns_agent.sh: usage: netns_agent.sh HOST COMMAND..." >&2; exit 2; }
host=$1
shift
case $host in fl-node[0-9]*) ;; *) echo "netns_agent.sh: unknown host '$host' (not an fl-nodeN namespace)" >&2; exit 2 ;; esac
exec env -i PATH="$PATH" HOME="${HOME:-/root}" USER="${USER:-root}" LANG=C.UTF-8 \
  ip netns exec "$host" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$host" "$*"
