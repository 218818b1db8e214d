#!/usr/bin/env bash
# Fuzz every parser a user's file reaches (tests/fuzz.rs) for SECONDS each.
#
#   scripts/fuzz.sh 600                  every target, 10 minutes each
#   scripts/fuzz.sh 60 config_toml,conll  two targets, a minute each
#
# Findings (inputs that panic, hang, allocate without bound, or are refused with an error that
# is not one line naming the file) land in target/fuzz-findings/TARGET/; replay one with
#   FUZZ_REPLAY=FILE FUZZ_TARGETS=TARGET cargo test --release --test fuzz
# A run with a new FUZZ_SEED explores other mutations.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
targets=${2:-}
FUZZ_SECONDS=$seconds FUZZ_TARGETS=$targets cargo test --release --test fuzz
