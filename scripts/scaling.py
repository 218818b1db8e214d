#!/usr/bin/env python3
"""Multi-node scaling on the simulated cluster (scripts/sim_cluster.sh); run by scripts/scaling.sh.

DistilBERT-base QA shapes (configs/bench/distilbert-qa.toml: random init, XQuAD windows, padded)
at seq 384 and 128, batch 4 per process, fp32 compute, 1 thread per process:

* the reference: one process with 2-fold accumulation (the same global batch of 8);
* 2 nodes x 1 rank, over links shaped to 1, 10 and 25 Gbit/s and unshaped, with fp32 and
  with bf16 on the wire;
* bytes on the links at N = 2 and N = 4 nodes, fp32 against bf16.

With --pairs N it runs only the acceptance row (seq 384, 25 Gbit/s, fp32 wire), each two-node
run right after its own reference, and prints the median efficiency of the N pairs; with
--transport mpi,tcp each pair runs the two-node job once per gradient transport
(dist.transport), so the transports compare against the same reference.

Per run it reads metrics.jsonl (steps after the first: step time, exposed communication, the
bytes the loop counts) and the sending node's veth counter between the first and the last step.
Then it fits a model of a step (compute, link bandwidth, latency, the share of communication
hidden behind backward) and predicts the efficiency of the blog's setup at 4-64 nodes.
Standard library only: it runs with the system python3.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "sprtrain"
SIM = ROOT / "scripts" / "sim_cluster.sh"
CONFIG = ROOT / "configs" / "bench" / "distilbert-qa.toml"
OUT = ROOT / "runs" / "scaling"
NAME = "scal"


def sh(*args, check=True, **kw):
    return subprocess.run([str(a) for a in args], check=check, text=True, **kw)


def physical_cores():
    """Physical cores among the CPUs this process may use (hyperthreads counted once)."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
        except OSError:
            cores.add(("", str(cpu)))
    return len(cores)


# --shared-cores: the nodes float over all of the machine's cores, so a node's communication
# can run on a core its training does not use at that moment.
SHARED_CORES = False


def cluster(nodes, rate=None):
    """Each node on its own cores where there are enough (as real nodes are): floating, the
    two ranks' threads and their network work land on one core at times, and step times
    swing by a third from run to run."""
    own = ["--own-cores"] if nodes <= physical_cores() and not SHARED_CORES else []
    sh(SIM, "down", "--name", NAME, capture_output=True, check=False)
    sh(SIM, "up", "--name", NAME, "--nodes", nodes, *own, *(["--rate", rate] if rate else []))


def tx_bytes(node):
    out = sh(SIM, "bytes", f"{NAME}-n{node}", capture_output=True).stdout.split()
    return int(out[0])


def settings(seq, steps, accum, wire, out, transport="mpi"):
    return [
        "--set", f"dist.transport={transport}",
        "--config", CONFIG,
        "--set", f"model.max_seq_len={seq}",
        "--set", f"qa.doc_stride={128 if seq >= 256 else 32}",
        "--set", "train.batch_size=4",
        "--set", f"train.gradient_accumulation_steps={accum}",
        "--set", f"train.max_steps={steps}",
        "--set", "runtime.threads=1",
        "--set", f"dist.reduce_dtype={wire}",
        "--set", f"train.output_dir={out}",
    ]


def efficiency(base, r):
    """Scaling efficiency: two processes' throughput over twice one process's. The reference
    runs the same global batch as 2 micro-batches in one process, so it is base step / 2 per
    process-step. The reference is measured with a twin on the other core (see `reference`):
    the simulated nodes share this machine's memory and caches, which real nodes don't."""
    return base["step_s"] / 2 / r["step_s"]


def reference(seq, steps):
    """The accumulation run, twice at once, each pinned to its own core: one process's speed
    on a machine as busy as each simulated node is (two processes, one per core)."""
    outs = [OUT / f"accum-{seq}-core{c}" for c in (0, 1)]
    for o in outs:
        sh("rm", "-rf", o)
    jobs = [subprocess.Popen(["taskset", "-c", str(c), str(BIN), *map(str, settings(seq, steps, 2, "fp32", o))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for c, o in enumerate(outs)]
    for j in jobs:
        if j.wait() != 0:
            sys.exit(f"reference run failed: {j.stderr.read()[-3000:]}")
    runs = [summarize(records(o)) for o in outs]
    for o in outs:
        drop_weights(o)
    return {"step_s": sum(r["step_s"] for r in runs) / 2, "losses": runs[0]["losses"]}


def summarize(recs):
    steady = recs[1:]
    return {
        "step_s": sum(8 / r["samples_per_s"] for r in steady) / len(steady),
        "comm_s": sum(r["time_comm_exposed_s"] for r in steady) / len(steady),
        "backward_s": sum(r["time_backward_s"] for r in steady) / len(steady),
        "bytes_counted": steady[-1].get("comm_bytes_sent_per_step", 0),
        "losses": [r["loss"] for r in recs],
    }


def drop_weights(out):
    """Keeps a run's metrics and config, not its checkpoint and final model: 0.8 GB a run at
    DistilBERT-base, 30 GB over a whole table, which once filled this disk."""
    for p in out.glob("checkpoint-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in out.glob("*.safetensors"):
        p.unlink()


def records(out):
    recs = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line still being written
            continue
        if "loss" in r and "samples_per_s" in r:
            recs.append(r)
    return recs


def run(cmd, out, watch_node=None):
    """Runs cmd; with watch_node, reads that node's tx counter when step 1 and the last step are
    logged, so the bytes exclude startup (config check, first weights)."""
    if out.exists():
        sh("rm", "-rf", out)
    job = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while job.poll() is None:
        if watch_node is not None and first is None and (out / "metrics.jsonl").exists():
            if len(records(out)) >= 1:
                first = tx_bytes(watch_node)
        time.sleep(0.02)
    err = job.stderr.read()
    if job.returncode != 0:
        sys.exit(f"run failed ({job.returncode}): {' '.join(map(str, cmd))}\n{err[-3000:]}")
    recs = records(out)
    drop_weights(out)
    last = tx_bytes(watch_node) if watch_node is not None else None
    result = summarize(recs)
    if first is not None and last is not None:
        result["bytes_link"] = (last - first) / (len(recs) - 1)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is warm-up")
    p.add_argument("--rates", default="1gbit,10gbit,25gbit,", help="link rates; empty = unshaped")
    p.add_argument("--seqs", default="384,128")
    p.add_argument("--json", default=str(OUT / "scaling.json"))
    p.add_argument("--report", metavar="JSON", help="only print the tables of an earlier run's JSON")
    p.add_argument("--reference-only", action="store_true", help="rerun the references into --json, then report")
    p.add_argument("--transport", default="mpi",
                   help="dist.transport of the two-node runs: mpi or tcp (with --pairs, a list: mpi,tcp)")
    p.add_argument("--pairs", type=int, default=0, metavar="N",
                   help="only the acceptance row (seq 384, 25 Gbit/s, fp32 wire): N alternations of the "
                        "reference and the two-node run, each pair's efficiency and their median")
    p.add_argument("--shared-cores", action="store_true",
                   help="the simulated nodes share all cores instead of one core each")
    a = p.parse_args()
    global SHARED_CORES
    SHARED_CORES = a.shared_cores
    if a.reference_only:
        results = json.loads(Path(a.json).read_text())
        for seq in [int(s) for s in a.seqs.split(",")]:
            results[f"accum-{seq}"] = reference(seq, a.steps)
            print(f"seq {seq}: reference {results[f'accum-{seq}']['step_s']:.2f} s/step", flush=True)
        Path(a.json).write_text(json.dumps(results, indent=1))
        a.report = a.json
    if a.report:
        results = json.loads(Path(a.report).read_text())
        rows = []
        for key, r in results.items():
            parts = key.split("-")
            if parts[0] == "n2":
                r["ratio"] = efficiency(results[f"accum-{parts[1]}"], r)
                rows.append((int(parts[1]), parts[2], parts[3], r))
        return report(results, rows)
    if os.geteuid() != 0:
        sys.exit("scaling.py: needs root (network namespaces)")
    transports = a.transport.split(",")
    if any(t not in ("mpi", "tcp") for t in transports) or (len(transports) > 1 and not a.pairs):
        sys.exit(f"scaling.py: --transport {a.transport}: mpi or tcp (a list only with --pairs)")
    if a.pairs:
        return pairs(a.pairs, a.steps, transports)
    transport = transports[0]
    mpirun = os.environ.get("SPRTRAIN_MPIRUN", "mpirun")
    OUT.mkdir(parents=True, exist_ok=True)
    rows, results = [], {"machine": os.uname().nodename, "steps": a.steps, "transport": transport}
    try:
        for seq in [int(s) for s in a.seqs.split(",")]:
            alone = run([BIN, *settings(seq, a.steps, 2, "fp32", OUT / f"alone-{seq}")], OUT / f"alone-{seq}")
            base = results[f"accum-{seq}"] = reference(seq, a.steps)
            results[f"alone-{seq}"] = alone
            print(f"seq {seq}: 1 process, 2-fold accumulation: {base['step_s']:.2f} s/step "
                  f"({alone['step_s']:.2f} s with the other core idle)", flush=True)
            for rate in a.rates.split(","):
                cluster(2, rate or None)
                for wire in ["fp32", "bf16"]:
                    out = OUT / f"n2-{seq}-{rate or 'unshaped'}-{wire}"
                    cmd = [SIM, "mpirun", "--name", NAME, "-n", 2, "-ppn", 1, BIN,
                           *settings(seq, a.steps, 1, wire, out, transport)]
                    r = run(cmd, out, watch_node=1)
                    r["ratio"] = efficiency(base, r)
                    results[out.name] = r
                    rows.append((seq, rate or "unshaped", wire, r))
                    print(f"seq {seq} {rate or 'unshaped':>8} {wire}: {r['step_s']:.2f} s/step, efficiency {r['ratio']:.3f}, "
                          f"exposed comm {r['comm_s']:.3f} s, link {r['bytes_link'] / 1e6:.1f} MB/step", flush=True)
        # Bytes per rank at N = 2 and 4 (unshaped, seq 128, two steps are enough).
        for nodes in [2, 4]:
            cluster(nodes)
            for wire in ["fp32", "bf16"]:
                out = OUT / f"bytes-n{nodes}-{wire}"
                cmd = [SIM, "mpirun", "--name", NAME, "-n", nodes, "-ppn", 1, BIN, *settings(128, 3, 1, wire, out, transport)]
                r = run(cmd, out, watch_node=nodes - 1)
                results[out.name] = r
                print(f"N={nodes} {wire}: link {r['bytes_link'] / 1e6:.1f} MB/step/rank, counted {r['bytes_counted'] / 1e6:.1f} MB", flush=True)
    finally:
        sh(SIM, "down", "--name", NAME, capture_output=True, check=False)
    Path(a.json).write_text(json.dumps(results, indent=1))
    report(results, rows)


def pairs(n, steps, transports):
    """The acceptance row n times, each two-node run right after its own reference: this VM's
    speed drifts by 15% within minutes, so only a run's own reference compares with it. With
    several transports, each pair runs one two-node job per transport after the reference."""
    effs = {t: [] for t in transports}
    try:
        cluster(2, "25gbit")
        for i in range(n):
            base = reference(384, steps)
            for t in transports:
                out = OUT / f"pair-{i}-{t}"
                r = run([SIM, "mpirun", "--name", NAME, "-n", 2, "-ppn", 1, BIN,
                         *settings(384, steps, 1, "fp32", out, t)], out)
                effs[t].append(efficiency(base, r))
                print(f"pair {i + 1} {t}: reference {base['step_s']:.2f} s/step, two nodes {r['step_s']:.2f} s/step, "
                      f"efficiency {effs[t][-1]:.3f}, exposed comm {r['comm_s']:.3f} s "
                      f"({100 * r['comm_s'] / r['step_s']:.1f}%)", flush=True)
    finally:
        sh(SIM, "down", "--name", NAME, capture_output=True, check=False)
    for t, e in effs.items():
        print(f"seq 384, 25 Gbit/s, fp32 wire, transport {t}: efficiency median {statistics.median(e):.3f} "
              f"of {n} pairs (spread {min(e):.3f}-{max(e):.3f})")


def report(results, rows):
    print("\n| seq | link | wire | s/step | scaling efficiency | exposed comm (s, % of step) | link MB/step/rank |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq, rate, wire, r in rows:
        print(f"| {seq} | {rate} | {wire} | {r['step_s']:.2f} | {r['ratio']:.3f} | "
              f"{r['comm_s']:.3f} ({100 * r['comm_s'] / r['step_s']:.1f}%) | {r['bytes_link'] / 1e6:.1f} |")
    print("\n| nodes | fp32 link MB/step/rank | bf16 link MB/step/rank | bf16 / fp32 |")
    print("| --- | --- | --- | --- |")
    for n in [2, 4]:
        f, b = results[f"bytes-n{n}-fp32"]["bytes_link"], results[f"bytes-n{n}-bf16"]["bytes_link"]
        print(f"| {n} | {f / 1e6:.1f} | {b / 1e6:.1f} | {b / f:.3f} |")
    model(results, rows)


PARAMS = 66_364_418  # DistilBertForQuestionAnswering
TAIL = 30_522 * 768 + 512 * 768  # the word and position embeddings: the last bucket backward fills


def model(results, rows):
    """A step is compute plus the communication not hidden behind backward:
        t_step = t_c + max(tail / bw, wire - f * t_backward),  wire = bytes / bw + latency,
    where `tail` is the last bucket (the embeddings), which is only ready when backward ends,
    and f is the share of backward that communication overlaps, fitted to the slowest link's
    fp32 run at seq 384. Then the blog's setup, 2 processes per node summing node-first."""
    fit = [r for seq, rate, wire, r in rows if seq == 384 and wire == "fp32" and rate == "1gbit"]
    if not fit:
        return
    r = fit[0]
    bw = 1e9 / 8
    wire_s = r["bytes_link"] / bw
    f = max(0.0, wire_s - r["comm_s"]) / r["backward_s"]
    print("\nmodel, fitted to seq 384, fp32 wire, 1 Gbit/s:")
    print(f"  {r['bytes_link'] / 1e6:.0f} MB/step on the link = {wire_s:.2f} s on the wire; "
          f"{r['comm_s']:.2f} s exposed; backward {r['backward_s']:.2f} s: f = {f:.2f} of backward overlaps")
    for seq, rate, wire, x in rows:
        if rate == "unshaped" or seq != 384:
            continue
        gbit = float(rate.rstrip("gbit"))
        link = gbit * 1e9 / 8
        tail = TAIL * (2 if wire == "bf16" else 4)
        pred = max(tail / link, x["bytes_link"] / link - f * x["backward_s"])
        print(f"  check: seq 384 {rate} {wire}: predicted exposed {pred:.2f} s, measured {x['comm_s']:.2f} s")
    # The blog: 26 min/epoch on one node of 2 processes, batch 32 each, SQuAD's 88,524 windows.
    t_c = 26 * 60 / (88_524 / 64)
    t_b = 2 * t_c / 3
    print(f"\nthe blog's setup: {t_c:.2f} s/step of compute (26 min/epoch over 88,524 windows at 2 x 32 "
          f"per node), backward 2/3 of it, 2 processes per node summing over shared memory first")
    print("\n| nodes | bytes/node/step, fp32 | 25 Gbit/s fp32 | 25 Gbit/s bf16 | 100 Gbit/s fp32 | 100 Gbit/s bf16 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for nodes in [4, 8, 16, 64]:
        share = 2 * (nodes - 1) / nodes
        cells = []
        for gbit in [25, 100]:
            link = gbit * 1e9 / 8
            for elem in [4, 2]:
                # A ring step costs ~50 us on Ethernet; 11 buckets of 25 MB each take 2 (M-1).
                wire_s = share * elem * PARAMS / link + 2 * (nodes - 1) * 50e-6 * 11
                exposed = max(share * elem * TAIL / link, wire_s - f * t_b)
                cells.append(f"{100 * t_c / (t_c + exposed):.0f}%")
        print(f"| {nodes} | {share * 4 * PARAMS / 1e6:.0f} MB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
