#!/usr/bin/env python3
"""The NER reference: transformers' Trainer fine-tunes a token-classification model as
run_ner.py does (transformers==5.23.0, torch==2.13.0, seqeval==1.2.2), with the settings of a
sprtrain config, so scripts/ner_compare.sh can put both side by side.

CoNLL files are read as sprtrain reads them (whitespace-separated `token ... tag` lines,
sentences split at blank lines, -DOCSTART- skipped); labels are the training file's sorted
distinct tags (run_ner.py's get_label_list); each word's first sub-token is labelled and the
rest -100; batches are padded per batch (DataCollatorForTokenClassification); metrics are
seqeval's, as run_ner.py's compute_metrics. Prints one JSON object: dev and test metrics
and the training time.
"""
import argparse
import json
import time
import tomllib
from pathlib import Path

import numpy as np
import torch
from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    Trainer,
    TrainingArguments,
)


def read_conll(path: Path):
    """[(words, tags)] of a CoNLL-style file."""
    sentences, words, tags = [], [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if not fields or fields[0] == "-DOCSTART-":
            if words:
                sentences.append((words, tags))
            words, tags = [], []
            continue
        words.append(fields[0])
        tags.append(fields[-1])
    if words:
        sentences.append((words, tags))
    return sentences


class Encoded(torch.utils.data.Dataset):
    def __init__(self, tok, sentences, label_to_id, max_len):
        enc = tok(
            [w for w, _ in sentences],
            is_split_into_words=True,
            truncation=True,
            max_length=max_len,
        )
        self.rows = []
        for i, (_, tags) in enumerate(sentences):
            previous, labels = None, []
            for w in enc.word_ids(i):
                labels.append(-100 if w is None or w == previous else label_to_id[tags[w]])
                previous = w
            self.rows.append(
                {
                    "input_ids": enc["input_ids"][i],
                    "attention_mask": enc["attention_mask"][i],
                    "labels": labels,
                }
            )

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True, help="the sprtrain TOML config to mirror")
    ap.add_argument("--test", type=Path, required=True, help="test file scored after training")
    ap.add_argument("--output", type=Path, default=Path("runs/ner-reference"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    cfg = tomllib.loads(args.config.read_text())
    model_dir = cfg["model"]["name_or_path"]
    max_len = cfg["model"].get("max_seq_len", 128)
    tc, dc = cfg["train"], cfg["data"]
    if args.threads:
        torch.set_num_threads(args.threads)

    train = read_conll(Path(dc["train_file"]))
    dev = read_conll(Path(dc["eval_file"]))
    test = read_conll(args.test)
    labels = sorted({t for _, tags in train for t in tags})
    label_to_id = {l: i for i, l in enumerate(labels)}
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForTokenClassification.from_pretrained(
        model_dir,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id=label_to_id,
    )

    def compute_metrics(p):
        predictions = np.argmax(p.predictions, axis=2)
        gold = [[labels[l] for l in row if l != -100] for row in p.label_ids]
        pred = [
            [labels[q] for q, l in zip(prow, lrow) if l != -100]
            for prow, lrow in zip(predictions, p.label_ids)
        ]
        return {
            "precision": precision_score(gold, pred),
            "recall": recall_score(gold, pred),
            "f1": f1_score(gold, pred),
            "accuracy": accuracy_score(gold, pred),
        }

    training_args = TrainingArguments(
        output_dir=str(args.output),
        num_train_epochs=tc.get("epochs", 3),
        per_device_train_batch_size=tc.get("batch_size", 32),
        per_device_eval_batch_size=cfg.get("eval", {}).get("batch_size", 64),
        learning_rate=tc.get("learning_rate", 5e-5),
        # transformers 5 takes a ratio of the steps as a float warmup_steps below 1.
        warmup_steps=tc.get("warmup_ratio") or tc.get("warmup_steps", 0),
        weight_decay=tc.get("weight_decay", 0.0),
        lr_scheduler_type=tc.get("lr_scheduler", "linear"),
        max_grad_norm=tc.get("max_grad_norm", 1.0),
        seed=cfg.get("runtime", {}).get("seed", 42),
        eval_strategy="no",
        save_strategy="no",
        logging_steps=tc.get("logging_steps", 50),
        report_to=[],
        use_cpu=True,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Encoded(tok, train, label_to_id, max_len),
        data_collator=DataCollatorForTokenClassification(tok),
        compute_metrics=compute_metrics,
    )
    started = time.time()
    trainer.train()
    train_s = time.time() - started
    result = {"train_s": train_s}
    for name, sentences in [("dev", dev), ("test", test)]:
        m = trainer.evaluate(Encoded(tok, sentences, label_to_id, max_len), metric_key_prefix=name)
        result[name] = {k.removeprefix(f"{name}_"): v for k, v in m.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
