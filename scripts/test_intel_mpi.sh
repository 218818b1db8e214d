#!/usr/bin/env bash
# Runs the 2-rank test suite (tests/mpi.rs) under the Intel MPI runtime, the MPI of real
# Sapphire Rapids clusters, with the binary built against Debian's MPICH: Intel MPI's
# libmpi.so.12 is ABI-compatible, reached through a libmpich.so.12 link on LD_LIBRARY_PATH.
# The runtime comes from PyPI (impi-rt) into a per-user cache; run after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
version=2021.19.0
impi="${SPRTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sprtrain}/impi-rt-$version"
if [ ! -f "$impi/.installed" ]; then
  echo "==> installing Intel MPI runtime impi-rt==$version into $impi"
  rm -rf "$impi"
  python3 -m venv "$impi"
  "$impi/bin/python" -m pip install -q --disable-pip-version-check --no-deps "impi-rt==$version"
  touch "$impi/.installed"
fi
shim="$impi/mpich-abi"
mkdir -p "$shim"
ln -sfn "$impi/lib/libmpi.so.12" "$shim/libmpich.so.12"
export I_MPI_ROOT="$impi"
export LD_LIBRARY_PATH="$shim:$impi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPRTRAIN_MPIRUN="$impi/bin/mpiexec.hydra"
echo "==> $("$SPRTRAIN_MPIRUN" --version 2>&1 | head -n 1)"
echo "==> the binary's MPI under it: $("$SPRTRAIN_MPIRUN" -n 1 target/release/sprtrain env | grep '^MPI')"
cargo test --release --test mpi --test mpi_qa --test zero --test cluster -- --test-threads 1
