#!/usr/bin/env bash
# Hydra's "ssh" into a node of the simulated cluster (scripts/sim_cluster.sh): MPICH's
# `mpiexec -launcher ssh -launcher-exec scripts/sim_launch.sh` and Intel MPI's
# `mpiexec.hydra -bootstrap ssh -bootstrap-exec scripts/sim_launch.sh` call it as they would
# call ssh: options, then the host, then the command (words the remote shell joins and runs).
# Instead of logging in, it enters the host's network and UTS namespaces and runs the
# command there with the caller's environment (Hydra forwards the job's environment itself).
set -euo pipefail
while [ $# -gt 0 ]; do
  case "$1" in
    -o | -p | -l | -i | -F) shift 2 ;; # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || { echo "sim_launch.sh: usage: sim_launch.sh [ssh options] HOST COMMAND..." >&2; exit 255; }
host=$1
shift
exec "$(dirname "$0")/sim_cluster.sh" exec "$host" sh -c "$*"
