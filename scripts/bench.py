#!/usr/bin/env python3
"""sprtrain against transformers' Trainer on the same work, in one run: scripts/bench.sh.

Rows (issue 6):
  a  DistilBERT-base QA shapes (random init), seq 384, batch 8, fp32, 2 threads, every window
     padded to 384: samples/s of each, the ratio, MFU against the fp32 GEMM peak measured here
  b  XQuAD windows as they come: run_qa.py's default (pad to 384) against sprtrain's default
     batching (pad to the batch's longest, length grouping): useful (non-pad) tokens/s
  c  startup: launch to the first training step, measured by this script's clock
  d  peak resident memory of the row-a process (wait4's ru_maxrss); row a again under
     glibc's malloc instead of tcmalloc, the allocator lever measured both ways
  e  one host, seq 128, global batch 16: 1 process x 2 threads against 2 x 1 (sprtrain under
     mpirun, the reference under torchrun with gloo DDP): throughput ratio, exposed comm %
  f  bf16 against fp32 at row a's shapes, where the CPU has bf16 units (AMX or AVX512-BF16)
  g  all-MiniLM-L6-v2 sequence classification on SST-2 sentences (configs/bench/minilm-sst2.toml),
     batch 32, batches padded to their longest, bf16 (where the CPU has bf16 units) and fp32,
     in random order and grouped by length on both sides, against Trainer with
     DataCollatorWithPadding (scripts/bench_reference_cls.py): samples/s and non-pad tokens/s
  h  the same on sentence pairs (consecutive SST-2 sentences, the first one's label), seq <= 128
  j  inference with the row-g model fine-tuned for 20 steps, fp32, batch 32: `sprtrain predict` on
     4,096 SST-2 sentences against transformers' text-classification pipeline, and `sprtrain eval`
     on the SST-2 dev set against Trainer.evaluate (scripts/bench_reference_infer.py); each
     side's own clock around its loop, examples/s
  l  causal-LM fine-tuning of a Llama-shaped 125M model (configs/bench/llama-125m-clm.toml:
     random init, 12 layers, 768 wide, GQA 12/4 heads, vocab 32k) on Tiny Shakespeare packed
     into 512-token blocks, batch 1, 2 threads, against Trainer (scripts/bench_reference_lm.py):
     tokens/s and MFU in fp32, bf16 where the CPU has bf16 units, LoRA r=16 on q/v (PEFT on the
     reference side) with peak memory against full fine-tuning
  k  what activation checkpointing saves and costs: row l's model in one process at seq 1024,
     2 threads, fp32, with and without train.gradient_checkpointing in `--repeats` alternating
     pairs, and once at seq 8 (next to no activations): activation memory (a run's peak RSS
     less the seq-8 run's) and step time, checkpointed against plain
  z  what does not fit one rank (docs/memory.md): the ZeRO stages 0-3 of row l's model on 2
     ranks, one thread each, fp32, against PyTorch's own counterparts over gloo (DDP,
     ZeroRedundancyOptimizer, FSDP2 without and with resharding after forward:
     scripts/zero_reference.py), tokens/s and the largest rank's peak RSS; each stage's
     tokens/s against stage 0's; the per-rank bytes of weights, gradients and optimizer state
     at 4 ranks, stage k against stage 0, as `sprtrain memory` models them for the 1.1B model;
     and the 1.1B model (configs/models/llama-1.1b) fully fine-tuned in one process, bf16 where
     the CPU has bf16 units, with activation checkpointing, against Trainer with
     gradient_checkpointing=True (one pair: about 6 minutes)
Rows g, h, k and l, like row a, report the medians of `--repeats` alternating pairs of runs; row z
runs its sprtrain stages in `--repeats` alternating rounds and reports their medians.

Each training run takes `steps` optimizer steps; the first `warmup` are not measured. A step's
time is the wall time between consecutive optimizer steps (data, forward, backward,
optimizer, logging: everything). The markdown table goes to stdout and OUT/bench.md, every
raw figure to OUT/bench.json.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# SPRTRAIN_BIN measures another build (a lever's "before") with the same script.
SPRTRAIN = Path(os.environ.get("SPRTRAIN_BIN", ROOT / "target/release/sprtrain"))
CONFIG = ROOT / "configs/bench/distilbert-qa.toml"
CLS_CONFIG = ROOT / "configs/bench/minilm-sst2.toml"
MINILM_DIR = ROOT / ".venv/minilm"
LM_CONFIG = ROOT / "configs/bench/llama-125m-clm.toml"
LM_MODEL_DIR = ROOT / "configs/models/llama-125m"
BIG_LM_DIR = ROOT / "configs/models/llama-1.1b"
MODEL_DIR = ROOT / "configs/models/distilbert-base-uncased"
PYTHON = sys.executable


def log(msg: str):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def launch(cmd, log_path: Path):
    """Runs cmd to completion; returns (launch unix time, wall s, ru_maxrss MiB)."""
    with open(log_path, "w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.time() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise SystemExit(f"bench: {' '.join(map(str, cmd))} failed ({proc.returncode}):\n{tail}")
    return t0, wall, usage.ru_maxrss / 1024


def cpu_info():
    text = Path("/proc/cpuinfo").read_text()
    model = next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in text.splitlines() if l.startswith("flags")), [])
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]
    return {"model": model, "logical_cpus": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


def gemm_peak(threads: int, kind: str, quick: bool):
    """GFLOP/s that libtorch's products (the same libtorch sprtrain links) sustain: the median
    of repeated products, for a square GEMM and the model's own shapes (batch x seq = 3072
    rows); the peak is the best shape's. fp32 reads both libraries libtorch carries, its BLAS
    (`a @ b`: MKL) and oneDNN's matmul (what sprtrain's `runtime.fp32_gemm` may pick), and
    takes the faster: MFU is against the best product this machine offers either side."""
    import torch

    torch.set_num_threads(threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[kind]
    shapes = [(2048, 2048, 2048), (3072, 768, 3072), (3072, 3072, 768), (3072, 768, 768)]
    best = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        products = {"": lambda: a @ b}
        if kind == "fp32":
            weight = b.t().contiguous()  # (n, k), a linear layer's layout

            def onednn():
                return torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], "")

            try:
                onednn()
                products[" onednn"] = onednn
            except RuntimeError:  # oneDNN's fp32 matmul needs AVX-512 BW/VL/DQ
                pass
        for label, product in products.items():
            for _ in range(2):
                product()
            reps = 3 if quick else 8
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                product()
                times.append(time.perf_counter() - t)
            best[f"{m}x{k}x{n}{label}"] = 2 * m * k * n / sorted(times)[len(times) // 2] / 1e9
    return max(best.values()), best


def model_flops_per_step(batch: int, seq: int) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3x forward) of DistilBERT-base
    for QA: 6 per weight per token for the linear layers, 12 B T^2 C per layer for attention's
    two products; embeddings, norms and activations are not counted (PaLM's convention)."""
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    c, ffn, layers = cfg["dim"], cfg["hidden_dim"], cfg["n_layers"]
    weights = layers * (4 * c * c + 2 * c * ffn) + 2 * c  # + the QA head
    return 6.0 * weights * batch * seq + 12.0 * layers * batch * seq * seq * c


def mean_step_s(run, warmup):
    """Mean seconds of the measured steps of a run (either side's result)."""
    return mean(run["step_s"][warmup:])


def useful_tokens_per_s(run, warmup):
    return sum(run["step_tokens"][warmup:]) / sum(run["step_s"][warmup:])


def lm_flops_per_step(tokens: int, seq: int) -> float:
    """Matmul FLOPs of one causal-LM training step of the row-l Llama: 6 per weight per token
    (projections, gated MLP, the untied LM head) plus 12 T^2 C per layer and sequence for
    attention's two products (counted whole, as PaLM does)."""
    cfg = json.loads((LM_MODEL_DIR / "config.json").read_text())
    c, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * c // cfg["num_attention_heads"]
    weights = layers * (2 * c * c + 2 * c * kv + 3 * c * i) + c * cfg["vocab_size"]
    return 6.0 * weights * tokens + 12.0 * layers * (tokens // seq) * seq * seq * c


def reference_lm_run(name, out_dir: Path, args):
    out = out_dir / f"{name}.json"
    cmd = [PYTHON, str(ROOT / "scripts/bench_reference_lm.py"), "--model-dir", str(LM_MODEL_DIR),
           "--tokenizer", str(ROOT / ".venv/minilm/tokenizer.json"), "--out", str(out)] + args
    log(f"reference {name}: {' '.join(args)}")
    t0, wall, rss = launch(cmd, out_dir / f"{name}.log")
    result = json.loads(out.read_text())
    result.update({"launch_unix": t0, "wall_s": wall, "ru_maxrss_mib": rss})
    return result


def zero_reference_run(name, out_dir: Path, stage: int, steps: int):
    """PyTorch's counterpart of ZeRO stage `stage` on row l's job, 2 ranks of one thread
    (scripts/zero_reference.py under torchrun): its step records and the largest rank's peak."""
    cmd = [str(Path(PYTHON).parent / "torchrun"), "--nproc-per-node", "2", str(ROOT / "scripts/zero_reference.py"),
           "--stage", str(stage), "--steps", str(steps), "--config", str(LM_CONFIG)]
    log(f"reference {name}: stage {stage} (2 processes)")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        t0, wall, rss = launch(cmd, out_dir / f"{name}.log")
    finally:
        del os.environ["OMP_NUM_THREADS"]
    records = [json.loads(l) for l in (out_dir / f"{name}.log").read_text().splitlines() if l.startswith('{"step"')]
    peaks = [json.loads(l)["peak_rss_mib"] for l in (out_dir / f"{name}.log").read_text().splitlines()
             if l.startswith('{"rank"')]
    return {"wall_s": wall, "ru_maxrss_mib": rss, "rank_peak_mib": max(peaks),
            "tokens_per_s": [r["tokens_per_s"] for r in records], "losses": [r["loss"] for r in records]}


def modelled_state_ratios(config: Path, sets) -> dict:
    """`sprtrain memory` at 4 processes, stages 0-3: each stage's weights + gradients +
    optimizer state a rank, over stage 0's."""
    cmd = [str(SPRTRAIN), "memory", "--config", str(config), "--processes", "4", "--stages", "0,1,2,3"]
    for s in sets:
        cmd += ["--set", s]
    table = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    state = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[0] == "4":
            state[int(cells[1])] = sum(float(c) for c in cells[3:6])
    return {stage: state[stage] / state[0] for stage in state}


def checkpointing_row(args, out_dir: Path, steps: int, warmup: int) -> dict:
    """Row k: activation memory and step time of Llama-125M at seq 1024, checkpointed against
    plain, in `repeats` alternating pairs (medians), over a seq-8 run's peak RSS."""
    text = ROOT.parent / "shared/data/tinyshakespeare/input.txt"
    run = lambda name, sets: sprtrain_run(name, out_dir, [f"data.train_file={text}"] + sets, steps, 1, config=LM_CONFIG)
    floor = run("k-seq8", ["model.max_seq_len=8"])["ru_maxrss_mib"]
    pairs = []
    for r in range(args.repeats):
        pair = {}
        for tag, on in (("plain", "false"), ("checkpointed", "true")):
            got = run(f"k-{tag}-{r + 1}", ["model.max_seq_len=1024", f"train.gradient_checkpointing={on}"])
            pair[tag] = {"activation_mib": max(0.0, got["ru_maxrss_mib"] - floor), "step_s": mean_step_s(got, warmup)}
        pairs.append(pair)
    return {"seq8_mib": floor, "pairs": pairs,
            "plain_activation_mib": median(p["plain"]["activation_mib"] for p in pairs),
            "checkpointed_activation_mib": median(p["checkpointed"]["activation_mib"] for p in pairs),
            "memory_ratio": median(p["checkpointed"]["activation_mib"] / p["plain"]["activation_mib"] for p in pairs),
            "step_ratio": median(p["checkpointed"]["step_s"] / p["plain"]["step_s"] for p in pairs)}


def zero_row(args, out_dir: Path, steps: int, warmup: int, bf16: bool) -> dict:
    """Row z: the ZeRO stages against PyTorch's, the modelled state per rank, and the 1.1B
    model with checkpointing against Trainer."""
    text = ROOT.parent / "shared/data/tinyshakespeare/input.txt"
    z = {"stages": {}}
    # sprtrain's stages in `repeats` alternating rounds (this VM's speed drifts by 10% within
    # minutes): each stage's figures are its rounds' medians; PyTorch's once each.
    ours = {stage: [] for stage in range(4)}
    for r in range(args.repeats):
        suffix = "" if r == 0 else f"-{r + 1}"
        for stage in range(4):
            run = sprtrain_run(f"z-sprtrain-stage{stage}{suffix}", out_dir, [f"data.train_file={text}", "runtime.threads=1",
                               "runtime.precision=fp32", f"dist.zero_stage={stage}"], steps, 2, procs=2, config=LM_CONFIG)
            # Both sides' tokens are both ranks' 512-token blocks; a step's time is its wall time.
            ours[stage].append((2 * 512 / mean_step_s(run, warmup), run["ru_maxrss_mib"]))
    for stage in range(4):
        ref = zero_reference_run(f"z-reference-stage{stage}", out_dir, stage, steps)
        ours_tps = median(t for t, _ in ours[stage])
        ref_tps = median(ref["tokens_per_s"][warmup:])
        z["stages"][stage] = {"sprtrain_tokens_per_s": ours_tps, "reference_tokens_per_s": ref_tps,
                              "ratio": ours_tps / ref_tps, "sprtrain_mib": max(m for _, m in ours[stage]),
                              "reference_mib": ref["rank_peak_mib"], "sprtrain_rounds": [t for t, _ in ours[stage]]}
    z["state_at_4_ranks"] = modelled_state_ratios(LM_CONFIG, [f"model.name_or_path={BIG_LM_DIR}", "train.gradient_checkpointing=true"])
    precision = "bf16" if bf16 else "fp32"
    big_steps, big_warmup = (3, 1) if args.quick else (5, 2)
    ours = sprtrain_run("z-sprtrain-1b", out_dir, [f"data.train_file={text}", "runtime.threads=2",
                        f"runtime.precision={precision}", f"model.name_or_path={BIG_LM_DIR}",
                        "train.gradient_checkpointing=true"], big_steps, 1, config=LM_CONFIG)
    ref = reference_lm_run("z-reference-1b", out_dir, ["--model-dir", str(BIG_LM_DIR), "--train-file", str(text),
                           "--steps", str(big_steps), "--threads", "2", "--precision", precision, "--gradient-checkpointing"])
    so, sr = mean_step_s(ours, big_warmup), mean_step_s(ref, big_warmup)
    z["1b"] = {"precision": precision, "sprtrain_tokens_per_s": 512 / so, "reference_tokens_per_s": 512 / sr,
               "ratio": sr / so, "sprtrain_mib": ours["ru_maxrss_mib"], "reference_mib": ref["ru_maxrss_mib"],
               "sprtrain_losses": ours["losses"], "reference_losses": ref["losses"], "steps": big_steps, "warmup": big_warmup}
    return z


def reference_cls_run(name, out_dir: Path, args):
    out = out_dir / f"{name}.json"
    cmd = [PYTHON, str(ROOT / "scripts/bench_reference_cls.py"), "--model-dir", str(MINILM_DIR),
           "--out", str(out)] + args
    log(f"reference {name}: {' '.join(args)}")
    t0, wall, rss = launch(cmd, out_dir / f"{name}.log")
    result = json.loads(out.read_text())
    result.update({"launch_unix": t0, "wall_s": wall, "ru_maxrss_mib": rss})
    return result


def sst2_pairs(sst2: Path, out: Path) -> Path:
    """Row h's data: consecutive SST-2 sentences as pairs, labelled with the first one's label."""
    lines = sst2.read_text(encoding="utf-8").splitlines()[1:]
    rows = [l.split("\t") for l in lines]
    pairs = ["sentence\tsentence2\tlabel"] + [
        f"{a[0]}\t{b[0]}\t{a[1]}" for a, b in zip(rows[0::2], rows[1::2])]
    out.write_text("\n".join(pairs) + "\n", encoding="utf-8")
    return out


def row_a_pairs(args, tag, kind, ref_args, sets, steps, before=None):
    """`args.repeats` alternating pairs of runs at row a's shapes (the reference, then
    sprtrain), the `kind` GEMM peak read before each pair (`before`: the first pair's reading,
    where already taken) and again between its two runs; a pair's peak is the higher reading.
    Returns [(reference run, sprtrain run, peak)] and the readings."""
    pairs, readings = [], []
    for r in range(args.repeats):
        suffix = "" if r == 0 else f"-{r + 1}"
        if r > 0 or before is None:
            before, _ = gemm_peak(2, kind, args.quick)
        ref = reference_run(f"{tag}-reference{suffix}", args.out, ref_args)
        after, shapes_after = gemm_peak(2, kind, args.quick)
        ours = sprtrain_run(f"{tag}-sprtrain{suffix}", args.out, sets, steps, 8)
        readings.append({"before": before, "after": after, "by_shape_after": shapes_after})
        pairs.append((ref, ours, max(before, after)))
    return pairs, readings


def summarize_row_a_pairs(pairs, warmup):
    """Medians over `row_a_pairs`: step times, samples/s, the ratio and MFU against each
    pair's own peak, with every pair's ratio and MFU for the spread."""
    flops = model_flops_per_step(8, 384)
    ref_steps = [mean_step_s(p[0], warmup) for p in pairs]
    our_steps = [mean_step_s(p[1], warmup) for p in pairs]
    ratios = [a / b for a, b in zip(ref_steps, our_steps)]
    our_mfus = [flops / s / (p[2] * 1e9) for s, p in zip(our_steps, pairs)]
    ref_mfus = [flops / s / (p[2] * 1e9) for s, p in zip(ref_steps, pairs)]
    ref_step, our_step = median(ref_steps), median(our_steps)
    return {
        "reference_step_s": ref_step, "sprtrain_step_s": our_step,
        "reference_samples_per_s": 8 / ref_step, "sprtrain_samples_per_s": 8 / our_step,
        "ratio": median(ratios), "ratios": ratios, "model_gflop_per_step": flops / 1e9,
        "gemm_peak_gflops": median([p[2] for p in pairs]),
        "reference_mfu": median(ref_mfus), "sprtrain_mfu": median(our_mfus),
        "sprtrain_mfus": our_mfus, "reference_mfus": ref_mfus,
        "reference_losses": pairs[0][0]["losses"], "sprtrain_losses": pairs[0][1]["losses"],
    }


def median_of_pairs(pairs):
    """One figure per field: the median over alternating pairs of runs, with every pair's
    ratio kept for the spread and the first pair's losses."""
    summary = {k: median([p[k] for p in pairs]) for k in pairs[0] if not k.endswith("losses")}
    summary.update({"ratios": [p["ratio"] for p in pairs],
                    "sprtrain_losses": pairs[0]["sprtrain_losses"],
                    "reference_losses": pairs[0]["reference_losses"]})
    return summary


def spread_text(summary):
    """'median of N alternating pairs, ratio spread A-B' for a `median_of_pairs` summary of
    several pairs; empty for one."""
    ratios = summary.get("ratios", [summary["ratio"]])
    if len(ratios) < 2:
        return ""
    return f"median of {len(ratios)} alternating pairs, ratio spread {min(ratios):.2f}x-{max(ratios):.2f}x"


def cls_rows(args, out_dir: Path, steps: int, warmup: int, bf16: bool):
    """Rows g and h: for each data set, precision and order, sprtrain and Trainer alternately."""
    sst2 = ROOT.parent / "shared/data/sst2/train.tsv"
    data_sets = {"g": (sst2, "")}
    if "h" in args.rows:
        data_sets["h"] = (sst2_pairs(sst2, out_dir / "sst2-pairs.tsv"), "sentence2")
    if "g" not in args.rows:
        del data_sets["g"]
    precisions = (["bf16"] if bf16 else []) + ["fp32"]
    rows = {}
    for row, (data, pair) in data_sets.items():
        rows[row] = {}
        for precision in precisions:
            for order in ["random", "grouped"]:
                tag = f"{row}-{precision}-{order}"
                sets = [f"data.train_file={data}", f"runtime.precision={precision}",
                        f"data.group_by_length={str(order == 'grouped').lower()}"]
                ref_args = ["--train-file", str(data), "--steps", str(steps), "--precision", precision]
                if pair:
                    sets.append(f"data.text_pair_column={pair}")
                    ref_args += ["--pair-column", pair]
                if order == "grouped":
                    ref_args.append("--group-by-length")
                # `repeats` alternating pairs of runs; the figures are the medians of the
                # pairs, the ratio's spread alongside (one pair swings by 20% on these VMs).
                pairs = []
                for r in range(args.repeats):
                    suffix = f"-{r + 1}" if r else ""
                    ref = reference_cls_run(f"{tag}-reference{suffix}", out_dir, ref_args)
                    ours = sprtrain_run(f"{tag}-sprtrain{suffix}", out_dir, sets, steps, 32, config=CLS_CONFIG)
                    so, sr = mean_step_s(ours, warmup), mean_step_s(ref, warmup)
                    pairs.append({
                        "sprtrain_samples_per_s": 32 / so, "reference_samples_per_s": 32 / sr, "ratio": sr / so,
                        "sprtrain_tokens_per_s": useful_tokens_per_s(ours, warmup),
                        "reference_tokens_per_s": useful_tokens_per_s(ref, warmup),
                        "sprtrain_losses": ours["losses"], "reference_losses": ref["losses"],
                    })
                rows[row][f"{precision}-{order}"] = median_of_pairs(pairs)
    return rows


def inference_row(out_dir: Path):
    """Row j: prediction and evaluation loops of a fine-tuned MiniLM, each side's own clock."""
    import re

    sst2 = ROOT.parent / "shared/data/sst2"
    model = out_dir / "j-model"
    base = ["--config", str(CLS_CONFIG), "--set", "runtime.precision=fp32"]
    log("sprtrain j: fine-tuning the model both sides run")
    launch([str(SPRTRAIN)] + base + ["--set", f"train.output_dir={model}", "--set", "train.max_steps=20",
                                     "--set", "train.save_steps=0"], out_dir / "j-train.log")
    inputs = out_dir / "j-input.jsonl"
    lines = (sst2 / "train.tsv").read_text(encoding="utf-8").splitlines()[1:4097]
    inputs.write_text("".join(json.dumps({"text": l.split("\t")[0]}) + "\n" for l in lines), encoding="utf-8")
    log("sprtrain j: predict and eval")
    launch([str(SPRTRAIN), "predict", "--model", str(model), "--task", "seq-cls", "--input", str(inputs),
            "--output", str(out_dir / "j-predictions.jsonl"), "--batch-size", "32", "--max-seq-len", "128"],
           out_dir / "j-predict.log")
    predicted = re.search(r"wrote (\d+) predictions to .* in ([\d.]+) s", (out_dir / "j-predict.log").read_text())
    launch([str(SPRTRAIN), "eval"] + base + ["--set", f"data.eval_file={sst2 / 'dev.tsv'}", "--set", "eval.batch_size=32",
                                             "--model", str(model), "--output", str(out_dir / "j-eval")],
           out_dir / "j-eval.log")
    evaluated = re.search(r"evaluated (\d+) features in ([\d.]+) s", (out_dir / "j-eval.log").read_text())
    out = out_dir / "j-reference.json"
    log("reference j: pipeline and Trainer.evaluate")
    launch([PYTHON, str(ROOT / "scripts/bench_reference_infer.py"), "--model-dir", str(model),
            "--predict-input", str(inputs), "--eval-file", str(sst2 / "dev.tsv"), "--out", str(out)],
           out_dir / "j-reference.log")
    ref = json.loads(out.read_text())
    ours_predict = int(predicted.group(1)) / float(predicted.group(2))
    ours_eval = int(evaluated.group(1)) / float(evaluated.group(2))
    theirs_predict = ref["predict_examples"] / ref["predict_s"]
    theirs_eval = ref["eval_examples"] / ref["eval_s"]
    ours_loss = json.loads((out_dir / "j-eval" / "eval_results.json").read_text())["eval_loss"]
    return {
        "sprtrain_eval_loss": ours_loss, "reference_eval_loss": ref["eval_loss"],
        "sprtrain_predict_per_s": ours_predict, "reference_predict_per_s": theirs_predict,
        "predict_ratio": ours_predict / theirs_predict,
        "sprtrain_eval_per_s": ours_eval, "reference_eval_per_s": theirs_eval,
        "eval_ratio": ours_eval / theirs_eval,
    }


def sprtrain_run(name, out_dir: Path, sets, steps, batch, procs=1, config=CONFIG):
    """One sprtrain training run; the result has the reference's keys (step_s, step_tokens,
    first_step_unix, losses) plus sprtrain's own figures."""
    run_dir = out_dir / name
    args = [str(SPRTRAIN), "--config", str(config), "--set", f"train.output_dir={run_dir}",
            "--set", f"train.max_steps={steps}", "--set", "train.save_steps=0"]
    for s in sets:
        args += ["--set", s]
    cmd = (["mpirun", "-n", str(procs)] if procs > 1 else []) + args
    log(f"sprtrain {name}: {' '.join(sets)}" + (f" ({procs} processes)" if procs > 1 else ""))
    t0, wall, rss = launch(cmd, out_dir / f"{name}.log")
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "loss" in r]
    # A step's record gives samples/s and tokens/s over its own wall time.
    step_s = [batch / r["samples_per_s"] for r in steps_]
    begin = next(r for r in records if r.get("event") == "train_begin")
    end = next(r for r in records if r.get("event") == "train_end")
    result = {
        "launch_unix": t0, "wall_s": wall, "ru_maxrss_mib": rss,
        "first_step_unix": begin["unix_time"], "startup_internal_s": begin.get("startup_s"),
        "startup_phases": begin.get("startup_phases"),
        "peak_rss_mib": end.get("peak_rss_mib"),
        "step_s": step_s,
        "step_tokens": [r["tokens_per_s"] * s for r, s in zip(steps_, step_s)],
        "losses": [r["loss"] for r in steps_],
        "comm_exposed_s": [r["time_comm_exposed_s"] for r in steps_],
    }
    shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints: hundreds of MB each
    return result


def reference_run(name, out_dir: Path, args, procs=1):
    out = out_dir / f"{name}.json"
    cmd = [str(ROOT / "scripts/bench_reference.py"), "--model-dir", str(MODEL_DIR), "--out", str(out).replace(".json", ".{rank}.json")] + args
    if procs > 1:
        cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] + cmd
    else:
        cmd = [PYTHON] + cmd
    log(f"reference {name}: {' '.join(args)}" + (f" ({procs} processes)" if procs > 1 else ""))
    t0, wall, rss = launch(cmd, out_dir / f"{name}.log")
    result = json.loads(Path(str(out).replace(".json", ".0.json")).read_text())
    result.update({"launch_unix": t0, "wall_s": wall, "ru_maxrss_mib": rss})
    return result


def mean(xs):
    return sum(xs) / len(xs)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 steps a run (1 warm-up) instead of 12 (2)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bench")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared/data/squad/xquad.en.json")
    ap.add_argument("--repeats", type=int, default=3, help="alternating pairs of runs in rows a, g, h, k and l, alternating rounds of row z's sprtrain stages (medians reported)")
    ap.add_argument("--rows", default="abcdefghjklz", help="which rows to run (a-d come from one pair of runs)")
    args = ap.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"bench: {args.data} not found (XQuAD English, ../shared/data/squad)")
    if not SPRTRAIN.is_file():
        raise SystemExit(f"bench: {SPRTRAIN} not built (scripts/bench.sh builds it)")
    args.out.mkdir(parents=True, exist_ok=True)
    steps, warmup = (4, 1) if args.quick else (12, 2)
    data = str(args.data)
    cpu = cpu_info()
    import torch
    import transformers

    started = time.time()
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "scripts/bench.sh" + (" --quick" if args.quick else ""),
        "machine": {**cpu, "kernel": platform.release()},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "reference": {"torch": torch.__version__, "transformers": transformers.__version__},
        "steps": steps, "warmup": warmup,
        "rows": {},
    }
    rows = report["rows"]
    base = ["data.train_file=" + data, "runtime.threads=2", "runtime.precision=fp32"]
    ref_base = ["--train-file", data, "--steps", str(steps)]

    peak, shapes = gemm_peak(2, "fp32", args.quick)
    report["gemm_fp32_gflops"] = {"peak": peak, "by_shape": shapes}
    log(f"fp32 GEMM peak, 2 threads: {peak:.1f} GFLOP/s")

    if set("abcd") & set(args.rows):
        # Row a: `repeats` alternating pairs of runs, each pair after its own GEMM peak; the
        # figures are medians, with their spread. Rows b-d use the first pair.
        pairs, readings = row_a_pairs(args, "a", "fp32", ref_base + ["--threads", "2", "--precision", "fp32", "--padding", "max_length"], base, steps, before=peak)
        report["gemm_fp32_gflops"]["readings"] = readings
        ref, ours = pairs[0][0], pairs[0][1]
        rows["a"] = summarize_row_a_pairs(pairs, warmup)
        peak = report["gemm_fp32_gflops"]["peak"] = rows["a"]["gemm_peak_gflops"]
        log(f"fp32 GEMM peak (median of the pairs' higher readings): {peak:.1f} GFLOP/s")
        our_step = rows["a"]["sprtrain_step_s"]
        # b: the reference's row-a run is run_qa.py's default batching on XQuAD windows.
        ref_tokens = useful_tokens_per_s(ref, warmup)
        dyn = sprtrain_run("b-sprtrain", args.out, base + ["data.pad_to_max_length=false", "data.group_by_length=true"], steps, 8)
        our_tokens = useful_tokens_per_s(dyn, warmup)
        # The reference's best setting too: padded per batch, grouped by length.
        best = reference_run("b-reference-best", args.out, ref_base + ["--threads", "2", "--precision", "fp32", "--padding", "longest", "--group-by-length"])
        best_tokens = useful_tokens_per_s(best, warmup)
        rows["b"] = {
            "reference_useful_tokens_per_s": ref_tokens, "sprtrain_useful_tokens_per_s": our_tokens,
            "ratio": our_tokens / ref_tokens,
            "reference_best_useful_tokens_per_s": best_tokens, "ratio_to_best": our_tokens / best_tokens,
            "sprtrain_padded_useful_tokens_per_s": useful_tokens_per_s(ours, warmup),
            "reference_useful_fraction": sum(ref["step_tokens"][warmup:]) / (8 * 384 * (steps - warmup)),
        }
        rows["c"] = {
            "reference_s": median([p[0]["first_step_unix"] - p[0]["launch_unix"] for p in pairs]),
            "sprtrain_s": median([p[1]["first_step_unix"] - p[1]["launch_unix"] for p in pairs]),
            "sprtrain_startup_phases": ours["startup_phases"],
            "sprtrain_internal_s": ours["startup_internal_s"],
        }
        # The allocator lever, measured both ways: the same run under glibc's malloc.
        glibc = sprtrain_run("a-sprtrain-glibc", args.out, base + ["runtime.allocator=system"], steps, 8)
        glibc_step = mean_step_s(glibc, warmup)
        rows["allocator"] = {
            "tcmalloc_samples_per_s": 8 / our_step, "glibc_samples_per_s": 8 / glibc_step,
            "tcmalloc_mib": ours["ru_maxrss_mib"], "glibc_mib": glibc["ru_maxrss_mib"],
        }
        rows["d"] = {
            "reference_mib": ref["ru_maxrss_mib"], "sprtrain_mib": ours["ru_maxrss_mib"],
            "ratio": ours["ru_maxrss_mib"] / ref["ru_maxrss_mib"],
            "reference_vmhwm_mib": ref["peak_rss_mib"], "sprtrain_vmhwm_at_train_end_mib": ours["peak_rss_mib"],
        }

    if "e" in args.rows:
        seq = ["model.max_seq_len=128", "qa.doc_stride=32"]
        ref_seq = ["--max-seq-len", "128", "--doc-stride", "32"]
        one = sprtrain_run("e-sprtrain-1x2", args.out, base + seq + ["train.batch_size=16"], steps, 16)
        two = sprtrain_run("e-sprtrain-2x1", args.out, [s for s in base if not s.startswith("runtime.threads")] + seq + ["runtime.threads=1", "train.batch_size=8"], steps, 16, procs=2)
        r_one = reference_run("e-reference-1x2", args.out, ref_base + ref_seq + ["--threads", "2", "--batch-size", "16"])
        r_two = reference_run("e-reference-2x1", args.out, ref_base + ref_seq + ["--threads", "1", "--batch-size", "8"], procs=2)
        s1, s2 = mean_step_s(one, warmup), mean_step_s(two, warmup)
        t1, t2 = mean_step_s(r_one, warmup), mean_step_s(r_two, warmup)
        rows["e"] = {
            "sprtrain_1x2_samples_per_s": 16 / s1, "sprtrain_2x1_samples_per_s": 16 / s2,
            "sprtrain_ratio": s1 / s2,
            "reference_1x2_samples_per_s": 16 / t1, "reference_2x1_samples_per_s": 16 / t2,
            "reference_ratio": t1 / t2,
            "sprtrain_comm_exposed_pct": 100 * mean(two["comm_exposed_s"][warmup:]) / s2,
        }

    if "f" in args.rows:
        if not ({"avx512_bf16", "amx_bf16"} & set(cpu["flags"])):
            rows["f"] = {"skipped": "no AMX/AVX512-BF16"}
        else:
            # The same alternating pairs as row a, in bf16, each against its own bf16 GEMM peak
            # (the fraction of it is issue 15's "bf16 at row a's shapes" figure).
            f_pairs, readings = row_a_pairs(args, "f", "bf16", ref_base + ["--threads", "2", "--precision", "bf16", "--padding", "max_length"], [s for s in base if "precision" not in s] + ["runtime.precision=bf16"], steps)
            f = summarize_row_a_pairs(f_pairs, warmup)
            f["gemm_bf16_readings"] = readings
            if "a" in rows:
                f["sprtrain_speedup_over_fp32"] = rows["a"]["sprtrain_step_s"] / f["sprtrain_step_s"]
                f["reference_speedup_over_fp32"] = rows["a"]["reference_step_s"] / f["reference_step_s"]
            rows["f"] = f

    if set("gh") & set(args.rows):
        cls_steps, cls_warmup = (8, 2) if args.quick else (40, 4)
        report["cls_steps"], report["cls_warmup"] = cls_steps, cls_warmup
        bf16 = bool({"avx512_bf16", "amx_bf16"} & set(cpu["flags"]))
        rows.update(cls_rows(args, args.out, cls_steps, cls_warmup, bf16))

    if "j" in args.rows:
        rows["j"] = inference_row(args.out)

    if "l" in args.rows:
        text = ROOT.parent / "shared/data/tinyshakespeare/input.txt"
        lm_base = ["runtime.threads=2", f"data.train_file={text}"]
        ref_lm = ["--train-file", str(text), "--steps", str(steps), "--threads", "2"]
        tokens = 512
        flops = lm_flops_per_step(tokens, 512)
        lm = {"model_gflop_per_step": flops / 1e9}
        variants = [("fp32", ["runtime.precision=fp32"], ["--precision", "fp32"]),
                    ("lora", ["runtime.precision=fp32", "lora.r=16", "lora.alpha=32"], ["--precision", "fp32", "--lora-r", "16"])]
        if {"avx512_bf16", "amx_bf16"} & set(cpu["flags"]):
            variants.insert(1, ("bf16", ["runtime.precision=bf16"], ["--precision", "bf16"]))
        for tag, ours_sets, ref_args in variants:
            pairs = []
            for r in range(args.repeats):
                suffix = f"-{r + 1}" if r else ""
                ours = sprtrain_run(f"l-sprtrain-{tag}{suffix}", args.out, lm_base + ours_sets, steps, 1, config=LM_CONFIG)
                ref = reference_lm_run(f"l-reference-{tag}{suffix}", args.out, ref_lm + ref_args)
                so, sr = mean_step_s(ours, warmup), mean_step_s(ref, warmup)
                pairs.append({"sprtrain_tokens_per_s": tokens / so, "reference_tokens_per_s": tokens / sr, "ratio": sr / so,
                              "sprtrain_mfu": flops / so / (peak * 1e9), "reference_mfu": flops / sr / (peak * 1e9),
                              "sprtrain_mib": ours["ru_maxrss_mib"], "reference_mib": ref["ru_maxrss_mib"],
                              "sprtrain_losses": ours["losses"], "reference_losses": ref["losses"]})
            lm[tag] = median_of_pairs(pairs)
        rows["l"] = lm

    if "k" in args.rows:
        rows["k"] = checkpointing_row(args, args.out, steps, warmup)
    if "z" in args.rows:
        rows["z"] = zero_row(args, args.out, steps, warmup, bool({"avx512_bf16", "amx_bf16"} & set(cpu["flags"])))

    report["bench_wall_s"] = time.time() - started
    table = markdown(report)
    (args.out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "bench.md").write_text(table)
    print(table)
    return 0


def markdown(rep) -> str:
    rows, peak = rep["rows"], rep["gemm_fp32_gflops"]["peak"]
    yes = lambda ok: "yes" if ok else "**no**"
    lines = [
        f"sprtrain {rep['commit']} against transformers {rep['reference']['transformers']} Trainer "
        f"(torch {rep['reference']['torch']}), {rep['date']}, `{rep['command']}` "
        f"({rep['steps']} steps a run, the first {rep['warmup']} not measured"
        + (f"; rows g and h {rep['cls_steps']}, the first {rep['cls_warmup']} not measured" if "cls_steps" in rep else "")
        + f"; {rep['bench_wall_s'] / 60:.1f} min)",
        f"Machine: {rep['machine']['model']}, {rep['machine']['logical_cpus']} logical CPUs, "
        f"flags {' '.join(rep['machine']['flags'])}; fp32 GEMM peak {peak:.1f} GFLOP/s (2 threads, this run: "
        "the median rate of the best of four shapes, fp32 in either of libtorch's libraries (MKL, oneDNN); with row a, the median over its pairs of runs of the higher of the readings before and after the reference's run)",
        "",
        "| row | measure | sprtrain | reference | sprtrain / reference | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    spread = lambda xs, f: f"{f(min(xs))}-{f(max(xs))}" if len(xs) > 1 else ""
    if "a" in rows:
        a = rows["a"]
        n = len(a.get("ratios", [a["ratio"]]))
        lines.append(f"| a | samples/s, DistilBERT-base QA, seq 384, batch 8, fp32, 2 threads, padded (median of {n} alternating pairs; ratio spread {spread(a.get('ratios', [a['ratio']]), lambda r: f'{r:.2f}x')}) | {a['sprtrain_samples_per_s']:.3f} | {a['reference_samples_per_s']:.3f} | {a['ratio']:.2f}x | >= 1.3x | {yes(a['ratio'] >= 1.3)} |")
        lines.append(f"| a | MFU ({a['model_gflop_per_step']:.0f} GFLOP a step / step time / GEMM peak; spread {spread(a.get('sprtrain_mfus', [a['sprtrain_mfu']]), lambda m: f'{100 * m:.1f}%')}) | {100 * a['sprtrain_mfu']:.1f}% | {100 * a['reference_mfu']:.1f}% | | >= 85% | {yes(a['sprtrain_mfu'] >= 0.85)} |")
    if "b" in rows:
        b = rows["b"]
        lines.append(f"| b | useful tokens/s, XQuAD windows (sprtrain: dynamic padding + length grouping; reference: run_qa.py's pad to 384, {100 * b['reference_useful_fraction']:.0f}% useful) | {b['sprtrain_useful_tokens_per_s']:.0f} | {b['reference_useful_tokens_per_s']:.0f} | {b['ratio']:.2f}x | >= 2x | {yes(b['ratio'] >= 2)} |")
        if "ratio_to_best" in b:
            lines.append(f"| b | the same, against Trainer's best setting (padded per batch, grouped by length) | {b['sprtrain_useful_tokens_per_s']:.0f} | {b['reference_best_useful_tokens_per_s']:.0f} | {b['ratio_to_best']:.2f}x | | |")
    if "c" in rows:
        c = rows["c"]
        lines.append(f"| c | startup: launch to first step, s (median of the row-a runs) | {c['sprtrain_s']:.2f} | {c['reference_s']:.2f} | {c['sprtrain_s'] / c['reference_s']:.2f}x | <= 1.0 s | {yes(c['sprtrain_s'] <= 1.0)} |")
    if "d" in rows:
        d = rows["d"]
        lines.append(f"| d | peak resident memory of the row-a process, MiB | {d['sprtrain_mib']:.0f} | {d['reference_mib']:.0f} | {d['ratio']:.2f}x | <= 0.7x | {yes(d['ratio'] <= 0.7)} |")
    if "allocator" in rows:
        m = rows["allocator"]
        lines.append(f"| a, d | the same with glibc's malloc instead of tcmalloc (`runtime.allocator = \"system\"`): samples/s, MiB | {m['glibc_samples_per_s']:.3f}, {m['glibc_mib']:.0f} | | | | |")
    if "e" in rows:
        e = rows["e"]
        lines.append(f"| e | samples/s 1 process x 2 threads, seq 128, global batch 16 | {e['sprtrain_1x2_samples_per_s']:.2f} | {e['reference_1x2_samples_per_s']:.2f} | {e['sprtrain_1x2_samples_per_s'] / e['reference_1x2_samples_per_s']:.2f}x | | |")
        lines.append(f"| e | samples/s 2 processes x 1 thread (mpirun / torchrun gloo DDP) | {e['sprtrain_2x1_samples_per_s']:.2f} | {e['reference_2x1_samples_per_s']:.2f} | {e['sprtrain_2x1_samples_per_s'] / e['reference_2x1_samples_per_s']:.2f}x | | |")
        ok = e["sprtrain_ratio"] >= 0.95 and e["sprtrain_ratio"] > e["reference_ratio"]
        lines.append(f"| e | 2x1 / 1x2 throughput (sprtrain: {e['sprtrain_comm_exposed_pct']:.1f}% of a step is exposed communication) | {e['sprtrain_ratio']:.3f} | {e['reference_ratio']:.3f} | | >= 0.95 and above the reference | {yes(ok)} |")
    if "f" in rows:
        f = rows["f"]
        if "skipped" in f:
            lines.append(f"| f | bf16 against fp32 | skipped: {f['skipped']} | | | | |")
        else:
            n = len(f["ratios"])
            lines.append(f"| f | samples/s bf16, row a's shapes (median of {n} alternating pairs; ratio spread {spread(f['ratios'], lambda r: f'{r:.2f}x')}) | {f['sprtrain_samples_per_s']:.3f} | {f['reference_samples_per_s']:.3f} | {f['ratio']:.2f}x | | |")
            lines.append(f"| i | bf16 at row a's shapes: model FLOPs / step time / bf16 GEMM peak ({f['gemm_peak_gflops']:.0f} GFLOP/s; spread {spread(f['sprtrain_mfus'], lambda m: f'{100 * m:.1f}%')}) | {100 * f['sprtrain_mfu']:.1f}% | {100 * f['reference_mfu']:.1f}% | | >= 75% | {yes(f['sprtrain_mfu'] >= 0.75)} |")
            if "sprtrain_speedup_over_fp32" in f:
                lines.append(f"| f | bf16 speed-up over fp32 | {f['sprtrain_speedup_over_fp32']:.2f}x | {f['reference_speedup_over_fp32']:.2f}x | | | |")
    for row, what in [("g", "MiniLM-L6 SST-2 sentences"), ("h", "MiniLM-L6 SST-2 sentence pairs")]:
        for variant, r in rows.get(row, {}).items():
            precision, order = variant.split("-")
            target = 1.3 if precision == "bf16" else 1.2
            order_text = "length-grouped" if order == "grouped" else "random order"
            pairs_text = spread_text(r) + "; " if spread_text(r) else ""
            lines.append(f"| {row} | samples/s, {what}, batch 32, padded per batch, {order_text}, {precision} ({pairs_text}non-pad tokens/s: {r['sprtrain_tokens_per_s']:.0f} and {r['reference_tokens_per_s']:.0f}) | {r['sprtrain_samples_per_s']:.1f} | {r['reference_samples_per_s']:.1f} | {r['ratio']:.2f}x | >= {target}x | {yes(r['ratio'] >= target)} |")
    if "j" in rows:
        j = rows["j"]
        lines.append(f"| j | examples/s, `sprtrain predict` against the text-classification pipeline, 4,096 SST-2 sentences, batch 32, fp32 | {j['sprtrain_predict_per_s']:.0f} | {j['reference_predict_per_s']:.0f} | {j['predict_ratio']:.2f}x | >= 1.5x | {yes(j['predict_ratio'] >= 1.5)} |")
        lines.append(f"| j | examples/s, `sprtrain eval` against Trainer.evaluate, SST-2 dev (872), batch 32, fp32 (eval_loss {j['sprtrain_eval_loss']:.4f} and {j['reference_eval_loss']:.4f}) | {j['sprtrain_eval_per_s']:.0f} | {j['reference_eval_per_s']:.0f} | {j['eval_ratio']:.2f}x | >= 1.5x | {yes(j['eval_ratio'] >= 1.5)} |")
    if "l" in rows:
        lm = rows["l"]
        f32 = lm["fp32"]
        spread = f" ({spread_text(f32)})" if spread_text(f32) else ""
        lines.append(f"| l | tokens/s, Llama-125M causal LM, seq 512, batch 1, fp32, 2 threads{spread} | {f32['sprtrain_tokens_per_s']:.0f} | {f32['reference_tokens_per_s']:.0f} | {f32['ratio']:.2f}x | >= 1.2x | {yes(f32['ratio'] >= 1.2)} |")
        lines.append(f"| l | MFU ({lm['model_gflop_per_step']:.0f} GFLOP a step / step time / fp32 GEMM peak) | {100 * f32['sprtrain_mfu']:.1f}% | {100 * f32['reference_mfu']:.1f}% | | >= 80% | {yes(f32['sprtrain_mfu'] >= 0.8)} |")
        if "bf16" in lm:
            b = lm["bf16"]
            lines.append(f"| l | tokens/s bf16 | {b['sprtrain_tokens_per_s']:.0f} | {b['reference_tokens_per_s']:.0f} | {b['ratio']:.2f}x | | |")
        lo = lm["lora"]
        lines.append(f"| l | tokens/s LoRA r=16 on q/v, fp32 | {lo['sprtrain_tokens_per_s']:.0f} | {lo['reference_tokens_per_s']:.0f} | {lo['ratio']:.2f}x | | |")
        mem = lo["sprtrain_mib"] / f32["sprtrain_mib"]
        lines.append(f"| l | peak resident memory, LoRA / full fine-tuning (MiB) | {mem:.2f} ({lo['sprtrain_mib']:.0f} / {f32['sprtrain_mib']:.0f}) | {lo['reference_mib'] / f32['reference_mib']:.2f} ({lo['reference_mib']:.0f} / {f32['reference_mib']:.0f}) | | <= 0.5x | {yes(mem <= 0.5)} |")
    if "k" in rows:
        k = rows["k"]
        n = len(k["pairs"])
        lines.append(f"| k | activation memory (peak RSS less a seq-8 run's {k['seq8_mib']:.0f} MiB), Llama-125M, seq 1024, one process, fp32, 2 threads: checkpointed / plain (medians of {n} alternating pairs) | {k['memory_ratio']:.2f} ({k['checkpointed_activation_mib']:.0f} / {k['plain_activation_mib']:.0f} MiB) | | | <= 0.35x | {yes(k['memory_ratio'] <= 0.35)} |")
        lines.append(f"| k | step time, the same runs: checkpointed / plain | {k['step_ratio']:.2f}x | | | <= 1.35x | {yes(k['step_ratio'] <= 1.35)} |")
    if "z" in rows:
        lines += zero_lines(rows["z"], yes)
    return "\n".join(lines) + "\n"


def zero_lines(z, yes) -> list:
    """Row z's lines of the table."""
    lines = []
    names = {0: "DDP", 1: "ZeroRedundancyOptimizer", 2: "FSDP2, no reshard after forward", 3: "FSDP2 FULL_SHARD"}
    stages = {int(k): v for k, v in z["stages"].items()}
    for stage, r in sorted(stages.items()):
        less = r["sprtrain_mib"] < r["reference_mib"]
        lines.append(f"| z | tokens/s, Llama-125M, 2 ranks x 1 thread, fp32, ZeRO stage {stage} against PyTorch's {names[stage]} (peak RSS of the largest rank: {r['sprtrain_mib']:.0f} and {r['reference_mib']:.0f} MiB{'' if less else ', **not less**'}) | {r['sprtrain_tokens_per_s']:.0f} | {r['reference_tokens_per_s']:.0f} | {r['ratio']:.2f}x | >= 1.2x, less memory | {yes(r['ratio'] >= 1.2 and less)} |")
    base = stages[0]["sprtrain_tokens_per_s"]
    for stage, floor in [(1, 0.95), (2, 0.95), (3, 0.85)]:
        share = stages[stage]["sprtrain_tokens_per_s"] / base
        lines.append(f"| z | sprtrain tokens/s, stage {stage} against stage 0 (medians of {len(stages[stage].get('sprtrain_rounds', [0]))} alternating rounds) | {stages[stage]['sprtrain_tokens_per_s']:.0f} | {base:.0f} | {share:.2f}x | >= {floor}x | {yes(share >= floor)} |")
    state = {int(k): v for k, v in z["state_at_4_ranks"].items()}
    for stage, cap in [(1, 0.65), (2, 0.5), (3, 0.3)]:
        lines.append(f"| z | weights + gradients + optimizer state a rank, 1.1B model, 4 ranks, stage {stage} against stage 0 (modelled: `sprtrain memory`) | {state[stage]:.2f}x | | | <= {cap}x | {yes(state[stage] <= cap)} |")
    b = z["1b"]
    lines.append(f"| z | tokens/s, 1.1B Llama full fine-tuning, one process, {b['precision']}, activation checkpointing, seq 512, 2 threads, against Trainer(gradient_checkpointing=True) ({b['steps']} steps, the first {b['warmup']} not measured; peak RSS {b['sprtrain_mib']:.0f} and {b['reference_mib']:.0f} MiB) | {b['sprtrain_tokens_per_s']:.1f} | {b['reference_tokens_per_s']:.1f} | {b['ratio']:.2f}x | >= 1.3x | {yes(b['ratio'] >= 1.3)} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
