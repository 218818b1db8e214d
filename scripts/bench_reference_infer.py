#!/usr/bin/env python3
"""The reference side of the benchmark's inference row (j), on a saved sequence-classification
model: transformers' `pipeline("text-classification")` over a JSON Lines file of texts
(batch_size as given), and `Trainer.evaluate` over a TSV evaluation file (batches padded to
their longest by DataCollatorWithPadding). Each is timed around the call alone (the model and
inputs loaded first), as the sprtrain side reports its own prediction and evaluation loops.
"""
import argparse
import csv
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--predict-input", type=Path, required=True, help="JSON Lines with a text field")
    ap.add_argument("--eval-file", type=Path, required=True, help="TSV: sentence, label")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                              Trainer, TrainingArguments, pipeline)

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_dir)
    model.eval()

    texts = [json.loads(line)["text"] for line in args.predict_input.read_text(encoding="utf-8").splitlines()]
    classify = pipeline("text-classification", model=model, tokenizer=tok, device="cpu")
    classify(texts[:args.batch_size], batch_size=args.batch_size, truncation=True, max_length=args.max_seq_len)
    start = time.perf_counter()
    predictions = classify(texts, batch_size=args.batch_size, truncation=True, max_length=args.max_seq_len)
    predict_s = time.perf_counter() - start
    assert len(predictions) == len(texts)

    with open(args.eval_file, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    enc = tok([r["sentence"] for r in rows], truncation=True, max_length=args.max_seq_len)
    features = [{**{k: enc[k][i] for k in enc}, "labels": int(r["label"])} for i, r in enumerate(rows)]
    scratch = tempfile.mkdtemp(prefix="bench-trainer-")
    trainer = Trainer(
        model=model,
        args=TrainingArguments(output_dir=scratch, per_device_eval_batch_size=args.batch_size, report_to="none",
                               disable_tqdm=True, use_cpu=True, dataloader_num_workers=0),
        data_collator=DataCollatorWithPadding(tok),
    )
    start = time.perf_counter()
    metrics = trainer.evaluate(eval_dataset=features)
    eval_s = time.perf_counter() - start
    shutil.rmtree(scratch, ignore_errors=True)
    Path(args.out).write_text(json.dumps({
        "predict_examples": len(texts), "predict_s": predict_s,
        "eval_examples": len(features), "eval_s": eval_s, "eval_loss": metrics.get("eval_loss"),
    }) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
