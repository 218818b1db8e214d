#!/usr/bin/env bash
# sprtrain against transformers' Trainer (scripts/bench_reference.py) on the same work, in one
# run on this machine: prints a markdown table, writes runs/bench/bench.{md,json}.
#
#   scripts/bench.sh            the full run (about 46 minutes on 2 cores: three alternating
#                               pairs of runs a row)
#   scripts/bench.sh --rows l   the decoder rows only (about 10 minutes)
#   scripts/bench.sh --quick    4 steps a run instead of 12, for development
#
# Needs ../shared/data/squad/xquad.en.json. Makes what it needs first: the release build and
# the reference venv (scripts/setup.sh --reference), and MPICH's mpirun for row e.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --reference >&2
exec .venv-ref/bin/python scripts/bench.py "$@"
