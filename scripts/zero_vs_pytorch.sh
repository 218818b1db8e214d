#!/usr/bin/env bash
# sprtrain's ZeRO stages against PyTorch's own counterparts on the same job (docs/memory.md):
# 2 ranks train Llama-125M (configs/bench/llama-125m-clm.toml: random init, seq 512, batch 1,
# fp32, one thread a rank) for `steps` steps; each stage runs sprtrain (`dist.zero_stage`) then
# scripts/zero_reference.py (DDP, ZeroRedundancyOptimizer, FSDP2 without and with resharding
# after forward), and the table gives the median tokens/s of the steps after the first 2 and
# each rank's peak RSS. Needs target/release/sprtrain and the reference venv
# (scripts/setup.sh --reference: .venv-ref).
# usage: scripts/zero_vs_pytorch.sh [steps (default 12)] [stages (default "0 1 2 3")]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
stages=${2:-"0 1 2 3"}
config=configs/bench/llama-125m-clm.toml
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

median_tokens() {
  python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{statistics.median(r['tokens_per_s'] for r in rows if 'loss' in r and r['step'] > 2):.0f}")
PY
}

echo "| stage | sprtrain tokens/s | PyTorch tokens/s | sprtrain peak RSS per rank (GB) | PyTorch peak RSS per rank (GB) |"
echo "| --- | --- | --- | --- | --- |"
for stage in $stages; do
  mpirun -n 2 /usr/bin/time -f "peak RSS %M KB" target/release/sprtrain --config "$config" \
    --set train.output_dir="$work/s$stage" --set train.max_steps="$steps" \
    --set train.save_steps=0 --set runtime.threads=1 --set dist.zero_stage="$stage" \
    >"$work/s$stage.log" 2>&1
  ours=$(median_tokens "$work/s$stage/metrics.jsonl")
  ours_rss=$(grep -o 'peak RSS [0-9]*' "$work/s$stage.log" | awk '{printf "%s%.2f", sep, $3/1048576; sep=" "}')
  rm -rf "${work:?}/s$stage"
  OMP_NUM_THREADS=1 .venv-ref/bin/torchrun --nproc-per-node 2 scripts/zero_reference.py \
    --stage "$stage" --steps "$steps" --config "$config" >"$work/t$stage.log" 2>&1
  theirs=$(median_tokens <(grep '^{"step"' "$work/t$stage.log"))
  theirs_rss=$(grep -o '"peak_rss_mib": [0-9.]*' "$work/t$stage.log" | awk '{printf "%s%.2f", sep, $2/1024; sep=" "}')
  echo "| $stage | $ours | $theirs | $ours_rss | $theirs_rss |"
done
