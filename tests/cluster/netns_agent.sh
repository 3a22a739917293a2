#!/usr/bin/env bash
# netns_agent.sh HOST COMMAND... — Open MPI's remote launcher (plm_rsh_agent)
# for the namespace hosts of netns.sh: what ssh would do, entering HOST
# (fl_netns_exec) instead of logging in. Like ssh, the command words are
# joined and run by a shell on the "remote" side, in a fresh environment
# (PATH, HOME, USER, LANG only), so whatever the ranks need must travel the
# way it would between machines (mpirun -x). Options before the host
# (ssh-style flags Open MPI may add) are ignored.
while [ $# -gt 0 ]; do
  case $1 in -*) shift ;; *) break ;; esac
done
[ $# -ge 2 ] || { echo "netns_agent.sh: usage: netns_agent.sh HOST COMMAND..." >&2; exit 2; }
host=$1
shift
[ -e "/run/netns/$host" ] || { echo "netns_agent.sh: unknown host '$host' (no network namespace of that name)" >&2; exit 2; }
. "$(dirname "$0")/netns.sh"
exec env -i PATH="$PATH" HOME="${HOME:-/root}" USER="${USER:-root}" LANG=C.UTF-8 \
  bash -c "$(declare -f fl_netns_exec); fl_netns_exec \"\$@\"" agent "$host" /bin/sh -c "$*"
