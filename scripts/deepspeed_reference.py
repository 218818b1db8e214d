#!/usr/bin/env python3
"""DeepSpeed's ZeRO through transformers' Trainer on CPU, the job of scripts/zero_reference.py
(Llama-125M from configs/models/llama-125m, random init, seq 512, batch 1 a rank, fp32, AdamW
at 5e-5, one thread a rank), for docs/memory.md. DeepSpeed is not in the reference venv;
install it beside it and run 2 ranks:

    .venv-ref/bin/pip install --target /tmp/ds --no-deps deepspeed hjson py-cpuinfo ninja msgpack einops
    PATH=/tmp/ds/bin:$PATH PYTHONPATH=/tmp/ds OMP_NUM_THREADS=1 \\
      .venv-ref/bin/torchrun --nproc-per-node 2 scripts/deepspeed_reference.py --stage 2

DeepSpeed picks its CPU accelerator (gloo) and JIT-compiles its shared-memory op on first use.
Prints one JSON line a rank: the median tokens/s (both ranks' 512-token blocks over a step's
wall time, steps after the first 2) and the rank's peak RSS.
"""
import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments,
                          default_data_collator)

ROOT = Path(__file__).resolve().parent.parent


class Clock(TrainerCallback):
    """When each optimizer step ends."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kw):
        self.ends.append(time.perf_counter())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], required=True)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "configs/models/llama-125m"))
    # The token ids do not change the cost: consecutive blocks of ids.
    blocks = [{"input_ids": list(range(i, i + 512)), "labels": list(range(i, i + 512))} for i in range(64)]
    ds = {"zero_optimization": {"stage": args.stage}, "train_micro_batch_size_per_gpu": 1,
          "gradient_accumulation_steps": 1, "bf16": {"enabled": False},
          "optimizer": {"type": "AdamW", "params": {"lr": 5e-5, "torch_adam": True}}}
    training = TrainingArguments(output_dir="/tmp/deepspeed-reference", per_device_train_batch_size=1,
                                 max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none",
                                 use_cpu=True, deepspeed=ds)
    clock = Clock()
    Trainer(model=model, args=training, train_dataset=blocks, data_collator=default_data_collator,
            callbacks=[clock]).train()
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])][1:]
    print(json.dumps({"stage": args.stage, "tokens_per_s": 2 * 512 / statistics.median(steps),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
