#!/usr/bin/env bash
# Fuzz every parser a user's file reaches (tests/fuzz.rs) for SECONDS each, the targets spread
# over one process per core (FUZZ_JOBS to choose).
#
#   scripts/fuzz.sh 600                   every target, 10 minutes each
#   scripts/fuzz.sh 60 config_toml,conll  two targets, a minute each
#
# Prints executions and findings per target. Findings (inputs that panic, hang, allocate without
# bound, or are refused with an error that is not one line naming the file) land in
# target/fuzz-findings/TARGET/; replay one with
#   FUZZ_REPLAY=FILE FUZZ_TARGETS=TARGET cargo test --release --test fuzz
# A run with another FUZZ_SEED explores other mutations.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-600}
jobs=${FUZZ_JOBS:-$(nproc)}
# Built once; the jobs run the harness itself (cargo would hold the build lock meanwhile).
harness=$(cargo test --release --test fuzz --no-run 2>&1 | sed -n 's/.*Executable tests\/fuzz.rs (\(.*\))/\1/p')
[ -x "$harness" ] || { echo "fuzz: cannot build the harness" >&2; exit 1; }
if [ -n "${2:-}" ]; then
  IFS=, read -r -a targets <<< "$2"
else
  mapfile -t targets < <(FUZZ_LIST=1 "$harness")
fi
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
pids=()
for ((j = 0; j < jobs && j < ${#targets[@]}; j++)); do
  mine=()
  for ((i = j; i < ${#targets[@]}; i += jobs)); do mine+=("${targets[i]}"); done
  names=$(IFS=,; echo "${mine[*]}")
  FUZZ_SECONDS=$seconds FUZZ_TARGETS=$names FUZZ_SEED=${FUZZ_SEED:-1} \
    "$harness" > "$logs/$j.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
cat "$logs"/*.log | grep -v '^$'
[ "$status" -eq 0 ] && echo "fuzz: no findings" || echo "fuzz: FINDINGS (see above)"
exit "$status"
