#!/usr/bin/env bash
# Launches sprtrain across nodes the way the Sapphire Rapids DistilBERT recipe launched
# run_qa.py: N processes, P per node, T compute threads each, optionally tcmalloc preloaded.
#
#   scripts/launch_cluster.sh -f configs/hostfile.example -n 8 -ppn 2 [-t THREADS] \
#       [--mpi mpich|intel] [--tcmalloc /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4] \
#       -- --config configs/bert.toml [--set ...]
#
# Needs: the same checkout path on every node (the binary's rpath points into its .venv),
# password-less ssh between nodes, and the data and output directory on a shared filesystem.
# THREADS defaults to sprtrain's own choice (the node's physical cores / P, less one for the
# communication thread). It prints the command it runs.
set -euo pipefail
cd "$(dirname "$0")/.."
hostfile="" n="" ppn="" threads="" mpi=mpich tcmalloc=""
while [ $# -gt 0 ]; do
  case "$1" in
    -f) hostfile=$2; shift 2 ;;
    -n) n=$2; shift 2 ;;
    -ppn) ppn=$2; shift 2 ;;
    -t) threads=$2; shift 2 ;;
    --mpi) mpi=$2; shift 2 ;;
    --tcmalloc) tcmalloc=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: scripts/launch_cluster.sh -f HOSTFILE -n N -ppn P [-t THREADS] [--mpi mpich|intel] [--tcmalloc LIB] -- SPRTRAIN_ARGS" >&2; exit 2 ;;
  esac
done
[ -n "$hostfile" ] && [ -n "$n" ] && [ -n "$ppn" ] || { echo "-f, -n and -ppn are required" >&2; exit 2; }
[ -f "$hostfile" ] || { echo "no hostfile $hostfile" >&2; exit 2; }
bin="$PWD/target/release/sprtrain"
[ -x "$bin" ] || { echo "build first: bash scripts/setup.sh" >&2; exit 2; }
env_args=()
[ -n "$threads" ] && env_args+=(-genv OMP_NUM_THREADS "$threads")
if [ -n "$tcmalloc" ]; then
  [ -f "$tcmalloc" ] || { echo "no $tcmalloc (Debian: apt-get install libgoogle-perftools4)" >&2; exit 2; }
  env_args+=(-genv LD_PRELOAD "$tcmalloc")
fi
case "$mpi" in
  mpich) launcher=mpiexec ;;
  intel)
    impi="${SPRTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sprtrain}/impi-rt-2021.19.0"
    [ -x "$impi/bin/mpiexec.hydra" ] || { echo "Intel MPI runtime missing: run scripts/test_intel_mpi.sh once" >&2; exit 2; }
    launcher="$impi/bin/mpiexec.hydra"
    # sprtrain pins its own threads; the ABI link lets the MPICH-built binary load Intel MPI.
    env_args+=(-genv I_MPI_PIN 0 -genv LD_LIBRARY_PATH "$impi/mpich-abi:$impi/lib")
    ;;
  *) echo "--mpi is mpich or intel" >&2; exit 2 ;;
esac
cmd=("$launcher" -f "$hostfile" -n "$n" -ppn "$ppn" "${env_args[@]}" "$bin" "$@")
echo "+ ${cmd[*]}"
exec "${cmd[@]}"
