#!/usr/bin/env bash
# NER side by side: sprtrain and transformers' Trainer fine-tune the same model with the same
# settings (configs/minilm-wnut17.toml by default) one after the other, then each scores the
# WNUT 2017 test file with seqeval's entity-level metrics. Needs the reference venv
# (`bash scripts/setup.sh --reference`) and ../shared/data/wnut17.
#   bash scripts/ner_compare.sh [CONFIG] [TEST_FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/minilm-wnut17.toml}
test_file=${2:-../shared/data/wnut17/emerging.test.annotated}
[ -f "$test_file" ] || { echo "no $test_file (../shared/data is beside the checkout)" >&2; exit 2; }
out=$(sed -n 's/^output_dir *= *"\(.*\)"/\1/p' "$config")
cargo build --release --quiet
start=$(date +%s.%N)
target/release/sprtrain --config "$config" --set train.overwrite_output_dir=true
train_s=$(echo "$(date +%s.%N) - $start" | bc)
target/release/sprtrain eval --config "$config" --set "data.eval_file=$test_file" \
  --output "$out/test" >/dev/null
reference=$(.venv-ref/bin/python scripts/ner_reference.py --config "$config" --test "$test_file" \
  --output runs/ner-reference | tail -1)
python3 - "$out" "$train_s" "$reference" <<'PY'
import json, sys
out, train_s, ref = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
dev = json.load(open(f"{out}/eval_results.json"))
test = json.load(open(f"{out}/test/eval_results.json"))
print("| side | train s | dev F1 | test precision | test recall | test F1 | test accuracy |")
print("| --- | --- | --- | --- | --- | --- | --- |")
print(f"| sprtrain | {train_s:.0f} | {dev['eval_f1']:.4f} | {test['eval_precision']:.4f} | "
      f"{test['eval_recall']:.4f} | {test['eval_f1']:.4f} | {test['eval_accuracy']:.4f} |")
t = ref["test"]
print(f"| Trainer | {ref['train_s']:.0f} | {ref['dev']['f1']:.4f} | {t['precision']:.4f} | "
      f"{t['recall']:.4f} | {t['f1']:.4f} | {t['accuracy']:.4f} |")
PY
