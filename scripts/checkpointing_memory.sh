#!/usr/bin/env bash
# What activation checkpointing saves and costs, measured (docs/memory.md): one process trains
# Llama-125M (configs/bench/llama-125m-clm.toml: batch 1, fp32, 2 threads) at seq 1024 with
# and without train.gradient_checkpointing, alternating, and at seq 8 (next to no
# activations); prints each run's peak RSS and median step time (steps after the first 2).
# Activation memory = peak at seq 1024 - peak at seq 8.
# usage: scripts/checkpointing_memory.sh [steps (default 8)] [pairs (default 2)]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-8}
pairs=${2:-2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# run TAG SEQ CHECKPOINTING: prints "TAG peak_gb step_s"
run() {
  /usr/bin/time -f "%M" -o "$work/$1.rss" target/release/sprtrain \
    --config configs/bench/llama-125m-clm.toml --set train.output_dir="$work/$1" \
    --set train.max_steps="$steps" --set model.max_seq_len="$2" \
    --set train.gradient_checkpointing="$3" >"$work/$1.log" 2>&1 ||
    { echo "$1 failed:"; tail -5 "$work/$1.log"; exit 1; }
  python3 - "$1" "$work/$1/metrics.jsonl" "$(cat "$work/$1.rss")" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[2])]
steps = [r for r in rows if "loss" in r][2:]
step_s = statistics.median(r["time_forward_s"] + r["time_backward_s"] + r["time_optimizer_s"] for r in steps)
print(f"{sys.argv[1]} {int(sys.argv[3]) / 1048576:.3f} {step_s:.3f}")
PY
}

run base-seq8 8 false
for pair in $(seq "$pairs"); do
  run "plain-$pair" 1024 false
  run "checkpointed-$pair" 1024 true
done
