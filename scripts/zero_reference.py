#!/usr/bin/env python3
"""The PyTorch side of the ZeRO comparison (scripts/zero_memory.sh, docs/memory.md): the run a
sprtrain TOML config describes (a causal LM from config.json, random init, fp32, its training
text packed into blocks of model.max_seq_len), trained data-parallel on CPU over gloo with
PyTorch's own counterparts of DeepSpeed's ZeRO stages:

  0  DistributedDataParallel + AdamW
  1  DDP + ZeroRedundancyOptimizer(AdamW): optimizer states sharded
  2  FSDP2 fully_shard(reshard_after_forward=False), each decoder layer then the root:
     gradients and optimizer states sharded, parameters kept gathered from forward to
     backward (FSDP1's SHARD_GRAD_OP)
  3  FSDP2 fully_shard(reshard_after_forward=True): parameters sharded too (FULL_SHARD)

usage: torchrun --nproc-per-node 2 scripts/zero_reference.py --stage S [--steps N]
           [--config configs/bench/llama-125m-clm.toml] [--checkpointing]

Rank 0 prints one JSON line a step ({"step", "loss" (the mean over ranks), "tokens_per_s" (all
ranks' tokens over the step's wall time)}), then every rank its {"rank", "peak_rss_mib"} and
rank 0 {"median_tokens_per_s"} over the steps after the first 2 (warm-up).
"""
import argparse
import json
import resource
import statistics
import time
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

# sprtrain resolves a config's relative paths from where it runs, which is the repo root in
# every script of this project.
ROOT = Path(__file__).resolve().parent.parent


def train_blocks(model_cfg: dict, train_file: Path, block: int) -> list[list[int]]:
    """run_clm.py's packing, as sprtrain does it: each line (its line break kept) encoded with
    its special tokens, all of them in one stream cut into disjoint blocks. The tokenizer is
    model.tokenizer_file where set (the 125M bench model has none of its own), else the model
    directory's tokenizer.json."""
    tok_file = model_cfg.get("tokenizer_file") or Path(model_cfg["name_or_path"]) / "tokenizer.json"
    tok = Tokenizer.from_file(str(ROOT / tok_file))
    # Without the file's own padding and truncation (MiniLM's pads every line to 128 tokens):
    # the blocks are cut from the plain stream.
    tok.no_padding()
    tok.no_truncation()
    # newline="\n": lines end at "\n" only, as Rust's read_line splits them.
    with open(train_file, encoding="utf-8", newline="\n") as f:
        lines = f.readlines()
    # In chunks: the Encoding objects of all lines at once would add ~100 MB to the peak RSS
    # this script reports.
    stream = []
    for at in range(0, len(lines), 2000):
        stream += [i for enc in tok.encode_batch(lines[at:at + 2000]) for i in enc.ids]
    return [stream[i:i + block] for i in range(0, len(stream) - block + 1, block)]


def wrap(model: torch.nn.Module, stage: int, lr: float, weight_decay: float):
    """The model as trained at `stage`, and its optimizer (built after wrapping: FSDP2 replaces
    the parameters by sharded DTensors)."""
    if stage >= 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=stage == 3)
        fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    # transformers' Trainer (and sprtrain) exempt biases and norm weights from weight decay.
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if "bias" not in n and "norm" not in n], "weight_decay": weight_decay},
        {"params": [p for n, p in named if "bias" in n or "norm" in n], "weight_decay": 0.0},
    ]
    if stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return model, ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=lr)
    return model, torch.optim.AdamW(groups, lr=lr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, choices=[0, 1, 2, 3], required=True)
    ap.add_argument("--steps", type=int, help="default: the config's train.max_steps")
    ap.add_argument("--config", type=Path, default=ROOT / "configs/bench/llama-125m-clm.toml")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    args = ap.parse_args()

    cfg = tomllib.loads(args.config.read_text())
    model_cfg, train = cfg["model"], cfg["train"]
    block, batch = model_cfg["max_seq_len"], train["batch_size"]
    steps = args.steps or train["max_steps"]

    # One thread a rank, as zero_memory.sh runs sprtrain (runtime.threads=1): 2 ranks on 2 cores.
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    blocks = train_blocks(model_cfg, ROOT / cfg["data"]["train_file"], block)
    # The same seed on every rank: identical initial weights whichever stage shards them.
    torch.manual_seed(cfg.get("runtime", {}).get("seed", 42))
    hf_config = AutoConfig.from_pretrained(ROOT / model_cfg["name_or_path"])
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if args.checkpointing or train.get("gradient_checkpointing", False):
        # transformers 5's name for gradient_checkpointing_enable (deprecated, warns); it
        # checkpoints non-reentrantly, which DDP and FSDP need.
        model.activation_checkpointing_enable()
    model.train()
    model, opt = wrap(model, args.stage, train.get("learning_rate", 5e-5), train.get("weight_decay", 0.0))

    rates = []
    for step in range(1, steps + 1):
        # Step k's global batch is the k-th run of world x batch blocks; each rank takes its slice
        # (cycling through the text if the steps outrun it).
        first = ((step - 1) * world + rank) * batch
        ids = torch.tensor([blocks[(first + i) % len(blocks)] for i in range(batch)])
        start = time.perf_counter()
        # use_cache=False: training builds no KV cache (sprtrain keeps none either).
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.get("max_grad_norm", 1.0))
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        rates.append(world * batch * block / elapsed)
        if rank == 0:
            print(json.dumps({"step": step, "loss": loss.item(), "tokens_per_s": rates[-1]}), flush=True)

    # One rank after the other, so the lines do not interleave.
    for r in range(world):
        if r == rank:
            print(json.dumps({"rank": rank, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
        dist.barrier()
    if rank == 0:
        print(json.dumps({"median_tokens_per_s": statistics.median(rates[2:]) if steps > 2 else None}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
