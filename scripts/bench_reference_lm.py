#!/usr/bin/env python3
"""The reference side of the benchmark's causal-LM rows: transformers' Trainer fine-tuning a
causal language model as run_clm.py sets it up (the model from config.json, random init; text
lines tokenized, concatenated and grouped into blocks of --block-size; labels = inputs), fully
or with PEFT LoRA (r, alpha, q_proj and v_proj), with or without gradient checkpointing. Records, for scripts/bench.py: when the first
step begins, the time between optimizer steps, the tokens of each step, the losses and the
peak resident memory.
"""
import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from bench_trainer import bench_training_args, step_clock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True, help="config.json")
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer.json")
    ap.add_argument("--train-file", type=Path, required=True, help="plain text")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--lora-r", type=int, default=0, help="0 = full fine-tuning")
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="each layer recomputed in backward: TrainingArguments(gradient_checkpointing=True), "
                         "named activation_checkpointing since transformers 5")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import (AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, Trainer,
                              default_data_collator)

    tok = PreTrainedTokenizerFast(tokenizer_file=str(args.tokenizer))
    lines = args.train_file.read_text(encoding="utf-8").splitlines(keepends=True)
    ids = [i for enc in tok(lines)["input_ids"] for i in enc]
    block = args.block_size
    need = args.steps * args.batch_size
    blocks = [ids[i:i + block] for i in range(0, len(ids) - block + 1, block)][:need]
    features = [{"input_ids": b, "labels": b} for b in blocks]
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_dir))
    if args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha,
                                                 target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))

    clock = step_clock()
    scratch = tempfile.mkdtemp(prefix="bench-trainer-")
    training_args = bench_training_args(scratch, args, learning_rate=5e-5,
                                        activation_checkpointing=args.gradient_checkpointing)
    Trainer(model=model, args=training_args, train_dataset=features, data_collator=default_data_collator,
            callbacks=[clock]).train()
    shutil.rmtree(scratch, ignore_errors=True)
    Path(args.out).write_text(json.dumps({
        **clock.timings(),
        "step_tokens": [block * args.batch_size] * len(clock.step_ends),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
