#!/usr/bin/env python3
"""The reference side of the benchmark's sequence-classification rows (g, h): transformers'
Trainer fine-tuning a sentence encoder (from_pretrained, a new classification head) on TSV
rows as run_glue.py sets it up: the fast tokenizer with truncation to --max-seq-len and no
padding, batches padded to their longest (`DataCollatorWithPadding`), in random order or
grouped by length (`train_sampling_strategy="group_by_length"`, Trainer's best setting for
short texts), AdamW with a linear schedule. Records, for scripts/bench.py: when the first step
begins, the time between optimizer steps, the non-pad and padded tokens of each step, the
losses and the peak resident memory.
"""
import argparse
import csv
import json
import shutil
import sys
import tempfile
from pathlib import Path

from bench_trainer import bench_training_args, step_clock


def read_rows(path: Path, text: str, pair: str, label: str):
    """(text, pair or None, label) of every row of a TSV file with a header."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        return [(r[text], r[pair] if pair else None, int(r[label])) for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True, help="a Hugging Face model directory")
    ap.add_argument("--train-file", type=Path, required=True, help="TSV with a header row")
    ap.add_argument("--text-column", default="sentence")
    ap.add_argument("--pair-column", default="", help="the second text of a pair, if any")
    ap.add_argument("--label-column", default="label")
    ap.add_argument("--num-labels", type=int, default=2)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--group-by-length", action="store_true")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                              Trainer)

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    rows = read_rows(args.train_file, args.text_column, args.pair_column, args.label_column)
    texts = [t for t, _, _ in rows]
    pairs = [p for _, p, _ in rows] if args.pair_column else None
    enc = tok(texts, pairs, truncation=True, max_length=args.max_seq_len)
    features = [{**{k: enc[k][i] for k in enc}, "labels": label} for i, (_, _, label) in enumerate(rows)]
    torch.manual_seed(args.seed)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_dir, num_labels=args.num_labels)

    pad = DataCollatorWithPadding(tok)
    real_tokens, padded_tokens = [], []  # of each batch collated, in order

    def collate(batch):
        out = pad(batch)
        real_tokens.append(int(out["attention_mask"].sum()))
        padded_tokens.append(int(out["attention_mask"].numel()))
        return out

    clock = step_clock()
    scratch = tempfile.mkdtemp(prefix="bench-trainer-")
    order = "group_by_length" if args.group_by_length else "random"
    training_args = bench_training_args(scratch, args, learning_rate=1e-4, train_sampling_strategy=order)
    Trainer(model=model, args=training_args, train_dataset=features, data_collator=collate,
            processing_class=tok, callbacks=[clock]).train()
    shutil.rmtree(scratch, ignore_errors=True)
    steps = len(clock.step_ends)
    Path(args.out).write_text(json.dumps({
        **clock.timings(),
        "step_tokens": real_tokens[:steps],
        "step_padded_tokens": padded_tokens[:steps],
    }) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
