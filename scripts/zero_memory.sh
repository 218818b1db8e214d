#!/usr/bin/env bash
# What each ZeRO stage costs and saves, measured (docs/memory.md): a job of 2 ranks on this
# machine trains Llama-125M (configs/bench/llama-125m-clm.toml: seq 512, batch 1, fp32, one
# thread a rank) for a few steps at dist.zero_stage 0 to 3, and for each stage prints
#   - tokens/s (the median of the steps after the first 2) and each rank's peak RSS, the
#     stages alternating for `rounds` rounds;
#   - the least memory the whole job runs in: the smallest memory-cgroup limit (bisected to
#     0.2 GB) under which it finishes 4 steps, the kernel taking back what it can (page cache, the
#     pages stage 2 marks free) and killing the job where it cannot.
# Needs root (a memory cgroup, v1 or v2) and a built target/release/sprtrain.
# usage: sudo scripts/zero_memory.sh [steps (default 12)] [rounds (default 2)] [stages (default "0 1 2 3")]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
rounds=${2:-2}
stages=${3:-"0 1 2 3"}
bin=target/release/sprtrain
config=configs/bench/llama-125m-clm.toml
work=$(mktemp -d)
trap 'rm -rf "$work"; for c in "$work".cg*; do rmdir "$c" 2>/dev/null || true; done' EXIT

if [ -d /sys/fs/cgroup/memory ]; then
  cgroot=/sys/fs/cgroup/memory limit_file=memory.limit_in_bytes unlimited=-1
else
  cgroot=/sys/fs/cgroup limit_file=memory.max unlimited=max
fi

# run STAGE LIMIT_BYTES TAG STEPS: trains in a fresh memory cgroup; exit status of the job.
# Only metrics.jsonl is kept of its output (each run's final save is 1.5 GB).
run() {
  local cg="$cgroot/sprtrain-zero-$$-$3"
  mkdir -p "$cg"
  echo "$2" >"$cg/$limit_file"
  (
    echo $BASHPID >"$cg/cgroup.procs"
    exec mpirun -n 2 /usr/bin/time -f "peak RSS %M KB" "$bin" --config "$config" \
      --set train.output_dir="$work/$3" --set train.max_steps="$4" \
      --set runtime.threads=1 --set dist.zero_stage="$1" >"$work/$3.log" 2>&1
  )
  local rc=$?
  rmdir "$cg" 2>/dev/null || true
  [ -f "$work/$3/metrics.jsonl" ] && mv "$work/$3/metrics.jsonl" "$work/$3.metrics.jsonl"
  rm -rf "${work:?}/$3"
  # A failure for want of disk is not one for want of memory.
  if grep -q "No space left on device" "$work/$3.log"; then
    echo "out of disk space in $work" >&2
    exit 1
  fi
  return $rc
}

median_tokens() {
  python3 - "$1.metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r["tokens_per_s"] for r in rows if "loss" in r][2:]
print(f"{statistics.median(steps):.0f}")
PY
}

# Throughput: the stages alternate, `rounds` times, without a memory limit.
declare -A tokens rss
for round in $(seq "$rounds"); do
  for stage in $stages; do
    tag="free$stage-$round"
    run "$stage" "$unlimited" "$tag" "$steps" || { echo "stage $stage failed:"; tail -5 "$work/$tag.log"; exit 1; }
    tokens[$stage]="${tokens[$stage]:-}${tokens[$stage]:+, }$(median_tokens "$work/$tag")"
    rss[$stage]="${rss[$stage]:-}${rss[$stage]:+, }$(grep -o 'peak RSS [0-9]*' "$work/$tag.log" | awk '{printf "%s%.2f", sep, $3/1048576; sep=" "}')"
  done
done

echo "| stage | tokens/s (by round) | peak RSS per rank (GB, by round) | least memory for the job (GB) |"
echo "| --- | --- | --- | --- |"
for stage in $stages; do
  # Bisect the least limit, in units of 0.2 GB, between 2 GB (too little at every stage)
  # and 8 GB (enough at every stage).
  lo=10 hi=40 try=0
  while [ $((hi - lo)) -gt 1 ]; do
    mid=$(((lo + hi) / 2)) try=$((try + 1))
    if run "$stage" "$((mid * 200000000))" "s$stage-$try" 4; then hi=$mid; else lo=$mid; fi
  done
  echo "| $stage | ${tokens[$stage]} | ${rss[$stage]} | $(awk -v h=$hi 'BEGIN{printf "%.1f", h/5}') |"
done
