#!/usr/bin/env bash
# Scaling on the simulated cluster (scripts/sim_cluster.sh): DistilBERT-base QA shapes at seq
# 384 and 128, 2 nodes x 1 rank x 1 thread against one process with 2-fold accumulation, over
# 1, 10 and 25 Gbit/s links and unshaped, fp32 and bf16 on the wire; bytes per rank at 2 and 4
# nodes; then a model of larger clusters. Prints its tables (docs/scaling.md has a run's).
# Each simulated node runs on its own core (sim_cluster.sh up --own-cores), or with
# `--shared-cores` the nodes share all of them.
# Needs root, ../shared/data/squad/xquad.en.json and the release build (scripts/setup.sh).
# About 25 minutes on 2 cores (--steps 4). Arguments go to scripts/scaling.py (--help);
# `--pairs 4` runs only the 25 Gbit/s fp32 seq-384 row, alternated with its reference;
# `--transport tcp` (or, with --pairs, `mpi,tcp`) sets dist.transport for the two-node runs.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f ../shared/data/squad/xquad.en.json ] || { echo "scaling.sh: needs ../shared/data/squad/xquad.en.json" >&2; exit 2; }
[ -x target/release/sprtrain ] || { echo "scaling.sh: build first: bash scripts/setup.sh" >&2; exit 2; }
exec python3 scripts/scaling.py "$@"
