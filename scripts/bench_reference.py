#!/usr/bin/env python3
"""The benchmark's reference side: what a user runs today instead of sprtrain.

transformers' Trainer (transformers==5.23.0, torch==2.13.0) trains a question-answering model
exactly as run_qa.py sets it up: the model built from config.json (random init), the fast
tokenizer, SQuAD-format examples cut into windows by run_qa.py's `prepare_train_features`
(question + context, context-only truncation, sliding windows with stride, start/end labels),
padded to max_seq_length (run_qa.py's default `pad_to_max_length=True`, collated by
`default_data_collator`) or padded per batch (`DataCollatorWithPadding`), AdamW with a linear
schedule. Run it plainly for one process or under `torchrun --nproc_per_node N` for DDP (gloo).

It records, for scripts/bench.py: the wall-clock time at which the first training step begins
(startup is measured from the launcher's clock), the time between consecutive optimizer steps,
the non-pad tokens of each step's batch, the losses and the process's peak resident memory.
It writes one JSON file per rank: --out with {rank} replaced.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from bench_trainer import bench_training_args, step_clock
from run_qa_labels import answer_positions


def squad_examples(path: Path):
    """(question, context, answer text, answer start) from SQuAD v1.1 JSON, in file order."""
    data = json.loads(path.read_text())["data"]
    return [
        (qa["question"], para["context"], qa["answers"][0]["text"], qa["answers"][0]["answer_start"])
        for article in data
        for para in article["paragraphs"]
        for qa in para["qas"]
    ]


def prepare_train_features(tok, examples, max_len: int, stride: int, pad_to_max: bool):
    """run_qa.py's `prepare_train_features`, on plain lists instead of a datasets.Dataset."""
    enc = tok(
        [q.lstrip() for q, _, _, _ in examples],
        [c for _, c, _, _ in examples],
        truncation="only_second",
        max_length=max_len,
        stride=stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length" if pad_to_max else False,
    )
    positions = answer_positions(tok, enc, [(text, start) for _, _, text, start in examples])
    features = []
    for i, (start, end) in enumerate(positions):
        feature = {k: enc[k][i] for k in tok.model_input_names if k in enc}
        feature["start_positions"] = start
        feature["end_positions"] = end
        features.append(feature)
    return features


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True, help="config.json and tokenizer.json")
    ap.add_argument("--train-file", type=Path, required=True, help="SQuAD v1.1 JSON")
    ap.add_argument("--max-seq-len", type=int, default=384)
    ap.add_argument("--doc-stride", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8, help="per process")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads per process")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--padding", choices=["max_length", "longest"], default="max_length")
    ap.add_argument("--group-by-length", action="store_true", help="Trainer's length-grouped sampler")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", required=True, help="result JSON; {rank} is replaced by the rank")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import (
        AutoConfig,
        AutoModelForQuestionAnswering,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        default_data_collator,
    )

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    features = prepare_train_features(
        tok, squad_examples(args.train_file), args.max_seq_len, args.doc_stride, args.padding == "max_length"
    )
    config = AutoConfig.from_pretrained(args.model_dir)
    torch.manual_seed(args.seed)
    model = AutoModelForQuestionAnswering.from_config(config)

    base_collator = (
        default_data_collator if args.padding == "max_length" else DataCollatorWithPadding(tok)
    )
    batch_tokens = []  # non-pad tokens of each batch this process collated, in order

    def collate(batch):
        out = base_collator(batch)
        batch_tokens.append(int(out["attention_mask"].sum()))
        return out

    clock = step_clock()
    scratch = tempfile.mkdtemp(prefix="bench-trainer-")
    # save_strategy "no": nothing of value is written to the scratch directory.
    ddp_backend = "gloo" if world > 1 else None
    order = "group_by_length" if args.group_by_length else "random"
    training_args = bench_training_args(scratch, args, learning_rate=5e-5, ddp_backend=ddp_backend,
                                        train_sampling_strategy=order)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=features,
        data_collator=collate,
        processing_class=tok,
        callbacks=[clock],
    )
    trainer.train()
    shutil.rmtree(scratch, ignore_errors=True)

    result = {
        "rank": rank,
        "world": world,
        "threads": args.threads,
        "precision": args.precision,
        "padding": args.padding,
        "batch_size": args.batch_size,
        "max_seq_len": args.max_seq_len,
        "windows": len(features),
        **clock.timings(),
        "step_tokens": batch_tokens[: len(clock.step_ends)],
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    Path(args.out.replace("{rank}", str(rank))).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
