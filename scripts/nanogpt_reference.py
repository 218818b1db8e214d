#!/usr/bin/env python3
"""nanoGPT's small CPU Shakespeare recipe in PyTorch, for comparison with
configs/gpt2-shakespeare-char.toml on the same machine.

The model and loop follow nanoGPT (karpathy/nanoGPT, train.py with
config/train_shakespeare_char.py and the README's CPU overrides: 4 layers, 4 heads, 128 wide,
block 64, batch 12, 2000 iterations, lr 1e-3 cosine to 1e-4 after 100 warmup iterations,
beta2 0.99, weight decay 0.1 on matrices, clipping at 1.0, dropout 0, no biases), written here
from that description. Batches are random windows of the first 90% of the text, as nanoGPT's
get_batch. Two validation figures at the end: nanoGPT's estimate (eval_iters=20 random
batches, 64 targets per window) and sprtrain's (every disjoint 64-token block of the last 10%,
63 targets per block).

    .venv-ref/bin/python scripts/nanogpt_reference.py [--data ../shared/data/tinyshakespeare/input.txt] [--seed 1337]
"""

import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width, bias=False)
        self.c_attn = nn.Linear(width, 3 * width, bias=False)
        self.attn_proj = nn.Linear(width, width, bias=False)
        self.ln_2 = nn.LayerNorm(width, bias=False)
        self.c_fc = nn.Linear(width, 4 * width, bias=False)
        self.mlp_proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, block, layers, heads, width):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, bias=False)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/tinyshakespeare/input.txt")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    text = open(args.data, encoding="utf-8").read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    train, val = data[:n], data[n:]
    block, batch, iters, warmup, lr, min_lr = 64, 12, 2000, 100, 1e-3, 1e-4
    model = Gpt(len(chars), block, 4, 4, 128)
    params = [p for p in model.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.99))

    def lr_at(it):
        if it < warmup:
            return lr * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / (iters - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)

    def windows(split, count):
        ix = torch.randint(len(split) - block, (count,))
        return torch.stack([split[i:i + block] for i in ix]), torch.stack([split[i + 1:i + 1 + block] for i in ix])

    start = time.time()
    model.train()
    for it in range(iters + 1):
        if it == iters:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(it)
        x, y = windows(train, batch)
        loss = F.cross_entropy(model(x).view(-1, len(chars)), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    train_s = time.time() - start
    model.eval()
    with torch.no_grad():
        estimate = []
        for _ in range(20):
            x, y = windows(val, batch)
            estimate.append(F.cross_entropy(model(x).view(-1, len(chars)), y.view(-1)).item())
        blocks = val[: len(val) // block * block].view(-1, block)
        total, count = 0.0, 0
        for chunk in blocks.split(128):
            logits = model(chunk)[:, :-1]
            total += F.cross_entropy(logits.reshape(-1, len(chars)), chunk[:, 1:].reshape(-1), reduction="sum").item()
            count += chunk[:, 1:].numel()
    print(json.dumps({"seed": args.seed, "val_loss_nanogpt_estimate": sum(estimate) / len(estimate),
                      "val_loss_all_blocks": total / count, "train_s": round(train_s, 1)}))


if __name__ == "__main__":
    main()
