//! Data parallelism under `mpirun -n 2` (MPICH's, or Intel MPI's with scripts/test_intel_mpi.sh).
//! Each test launches the job itself and checks the job's result; they skip with a message
//! where no `mpirun` is on PATH.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{
    fixtures, losses, require_mpirun, run_ok, weights, write_sentences, RunConfig, WORDS,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_sprtrain");

/// 236 labelled sentences: 29 steps of 8 examples, then a short step of 4 that only rank 0
/// has a micro-batch for (rank 1 takes part with zeros).
fn write_data(dir: &Path) -> PathBuf {
    let p = dir.join("train.tsv");
    write_sentences(&p, 236, 13, |i, n| (n + i / 7) % 2);
    // 41 evaluation rows: an odd count, so the two ranks' shards differ in size.
    let eval: String = std::iter::once("sentence\tlabel".to_string())
        .chain((0..41usize).map(|i| {
            format!(
                "{} {} {}\t{}",
                WORDS[i % 12],
                WORDS[(i * 7) % 12],
                WORDS[(i * 5 + 1) % 12],
                i % 2
            )
        }))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(dir.join("eval.tsv"), eval + "\n").unwrap();
    p
}

/// The tiny BERT classifier with dropout off (the transformers training-parity fixture), so
/// one micro-batch of 2B and two of B compute the same mean.
fn config(
    dir: &Path,
    data: &Path,
    name: &str,
    batch: usize,
    accum: usize,
    steps: usize,
) -> (PathBuf, PathBuf) {
    let out = dir.join(name);
    let path = RunConfig::new(&fixtures().join("train_parity"), data, &out)
        .set_path("data.eval_file", &data.with_file_name("eval.tsv"))
        .set("train.max_steps", steps as i64)
        .set("train.batch_size", batch as i64)
        .set("train.gradient_accumulation_steps", accum as i64)
        .set("train.learning_rate", 1e-3)
        .set("train.weight_decay", 0.01)
        .set("train.warmup_steps", 3)
        // Threads as a user's run gets them: this node's cores shared among its ranks.
        .set("runtime.threads", 0)
        .set("runtime.seed", 3)
        .write(&dir.join(format!("{name}.toml")));
    (path, out)
}

/// Two ranks with batch B against one rank with batch 2B, and against one rank with batch B and
/// accumulation 2: per-step losses within 1e-5 relative and final weights within 1e-5 (fp32;
/// the runs differ only in summation order and padding length).
#[test]
fn two_ranks_equal_one_rank_with_double_batch_or_accumulation() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let (c2, out2) = config(tmp.path(), &data, "two-ranks", 4, 1, 30);
    let mut cmd = Command::new(&mpirun);
    cmd.args(["-n", "2", BIN, "--config"]).arg(&c2);
    run_ok(cmd);
    let two = (losses(&out2), weights(&out2));
    assert_eq!(two.0.len(), 30);
    assert!(
        two.0.iter().any(|l| (l - two.0[0]).abs() > 1e-2),
        "losses did not move: {:?}",
        two.0
    );

    // Many small buckets, each launched as soon as backward completes its layer: the very same
    // sums, so the very same run.
    let (cb, outb) = config(tmp.path(), &data, "small-buckets", 4, 1, 30);
    let mut cmd = Command::new(&mpirun);
    cmd.args(["-n", "2", BIN, "--config"])
        .arg(&cb)
        .args(["--set", "dist.bucket_mb=0.01"]);
    run_ok(cmd);
    assert_eq!(losses(&outb), two.0, "bucketing changed the run");
    // bf16 on the wire: the same run to bf16 rounding of the gradients.
    let (cf, outf) = config(tmp.path(), &data, "bf16-wire", 4, 1, 30);
    let mut cmd = Command::new(&mpirun);
    cmd.args(["-n", "2", BIN, "--config"])
        .arg(&cf)
        .args(["--set", "dist.reduce_dtype=bf16"]);
    run_ok(cmd);
    let bf = losses(&outf);
    let worst = bf
        .iter()
        .zip(&two.0)
        .map(|(a, b)| ((a - b) / b).abs())
        .fold(0.0, f64::max);
    eprintln!("bf16 reduction: per-step loss max relative difference {worst:e}");
    assert!(worst > 0.0 && worst < 1e-2, "bf16 reduction: {worst}");

    for (name, batch, accum) in [("double-batch", 8, 1), ("accumulation", 4, 2)] {
        let (c1, out1) = config(tmp.path(), &data, name, batch, accum, 30);
        let mut cmd = Command::new(BIN);
        cmd.arg("--config").arg(&c1);
        run_ok(cmd);
        let one = (losses(&out1), weights(&out1));
        let worst = one
            .0
            .iter()
            .zip(&two.0)
            .map(|(a, b)| ((a - b) / b).abs())
            .fold(0.0, f64::max);
        eprintln!("{name}: per-step loss max relative difference {worst:e}");
        assert!(worst <= 1e-5, "{name}: losses {:?} vs {:?}", one.0, two.0);
        let mut wmax = 0.0f64;
        for ((n1, t1), (n2, t2)) in one.1.iter().zip(&two.1) {
            assert_eq!(n1, n2);
            wmax = wmax.max((t1 - t2).abs().max().double_value(&[]));
        }
        eprintln!("{name}: final weights max abs difference {wmax:e}");
        assert!(wmax <= 1e-5, "{name}: weights differ by {wmax}");
        // Evaluation sharded over two ranks and gathered equals one rank's.
        let results = |o: &Path| -> Value {
            serde_json::from_str(&std::fs::read_to_string(o.join("eval_results.json")).unwrap())
                .unwrap()
        };
        let (e1, e2) = (results(&out1), results(&out2));
        assert_eq!(e1["eval_accuracy"], e2["eval_accuracy"], "{e1} vs {e2}");
        let dl = (e1["eval_loss"].as_f64().unwrap() - e2["eval_loss"].as_f64().unwrap()).abs();
        eprintln!(
            "{name}: eval accuracy {} on both, eval loss differs by {dl:e}",
            e1["eval_accuracy"]
        );
        assert!(dl <= 1e-5);
    }
}

/// Ranks started with different configs (an MPMD launch, --set on rank 1 only) all stop with an
/// error naming the key and the ranks, fast, never hanging.
#[test]
fn mismatched_configs_stop_every_rank() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let (c, _) = config(tmp.path(), &data, "mpmd", 4, 1, 5);
    let start = Instant::now();
    let out = Command::new(&mpirun)
        .args(["-n", "1", BIN, "--config"])
        .arg(&c)
        .args([":", "-n", "1", BIN, "--config"])
        .arg(&c)
        .args(["--set", "train.learning_rate=2e-3"])
        .output()
        .unwrap();
    let took = start.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(!out.status.success());
    assert!(took < Duration::from_secs(30), "took {took:?}");
    let want = "differs between rank 0 and rank 1: rank 0 has `train.learning_rate = 0.001`, rank 1 has `train.learning_rate = 0.002`";
    // Rank 0 always reports; rank 1 usually does too, unless rank 0's MPI_Abort ends it first.
    assert!(
        stderr.contains(&format!(
            "sprtrain: rank 0: error: {}",
            "the resolved configuration"
        )),
        "{stderr}"
    );
    assert!(stderr.contains(want), "{stderr}");
}

/// Starts a long 2-rank run, waits until it trains (its metrics log grows), sends `signal`
/// to rank 1 and waits, at most 30 s, for the whole job to end. Returns its exit status, the
/// time it took after the signal, and its stderr.
fn signal_rank_1(
    mpirun: &str,
    name: &str,
    extra: &[&str],
    signal: i32,
) -> (std::process::ExitStatus, Duration, String) {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let (c, out) = config(tmp.path(), &data, name, 4, 1, 1_000_000);
    let mut job = Command::new(mpirun)
        .args(["-n", "2", BIN, "--config"])
        .arg(&c)
        .args(extra)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while losses_len(&out) < 3 {
        assert!(Instant::now() < deadline, "training never started");
        std::thread::sleep(Duration::from_millis(100));
    }
    let victim = rank_pid(&c, 1).expect("rank 1's process");
    let sent = Instant::now();
    unsafe { libc::kill(victim, signal) };
    let status = loop {
        if let Some(s) = job.try_wait().unwrap() {
            break s;
        }
        if sent.elapsed() > Duration::from_secs(30) {
            unsafe { libc::kill(victim, libc::SIGKILL) };
            let _ = job.kill();
            panic!("the job outlived the signal to rank 1 by 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = sent.elapsed();
    unsafe { libc::kill(victim, libc::SIGKILL) }; // a stopped rank may linger
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut job.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(rank_pid(&c, 0).is_none(), "rank 0 is still running");
    (status, took, stderr)
}

/// `kill -9` of rank 1 mid-run: the job ends, non-zero, within 30 s.
#[test]
fn killing_a_rank_ends_the_job() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let (status, took, _) = signal_rank_1(&mpirun, "victim", &[], libc::SIGKILL);
    eprintln!("job ended {took:?} after rank 1 was killed, status {status}");
    assert!(!status.success());
}

/// A rank that stops answering (SIGSTOP, as a hung node would): rank 0 reports the collective
/// it waited for past `dist.collective_timeout_s`, and the job ends non-zero.
#[test]
fn a_hung_rank_trips_the_collective_timeout() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let (status, took, stderr) = signal_rank_1(
        &mpirun,
        "hung",
        &["--set", "dist.collective_timeout_s=3"],
        libc::SIGSTOP,
    );
    eprintln!("job ended {took:?} after rank 1 hung, status {status}");
    assert!(!status.success());
    assert!(
        stderr.contains("sprtrain: rank 0: error: collective")
            && stderr.contains("did not finish within 3 s"),
        "{stderr}"
    );
}

fn losses_len(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .map(|s| s.lines().filter(|l| l.contains("\"loss\"")).count())
        .unwrap_or(0)
}

/// The pid of the sprtrain process of `rank` running `config`.
fn rank_pid(config: &Path, rank: usize) -> Option<i32> {
    let want = config.to_string_lossy().to_string();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if !cmdline.starts_with(BIN) || !cmdline.contains(&want) {
            continue;
        }
        let env = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        let env = String::from_utf8_lossy(&env).to_string();
        if env.split('\0').any(|kv| kv == format!("PMI_RANK={rank}")) {
            return Some(pid);
        }
    }
    None
}

/// Set in the environment of the ranks that `bf16_wire_sums_agree_within_rounding` launches.
const BF16_RANK_CHECK: &str = "SPRTRAIN_TEST_BF16_WIRE_RANK";

/// bf16 on the wire (reduce-scatter, fp32 sums, all-gather) at 2 and 4 ranks: the test runs
/// itself under mpirun, and each rank checks its own result (see `bf16_wire_rank_check`).
#[test]
fn bf16_wire_sums_agree_within_rounding() {
    if std::env::var_os(BF16_RANK_CHECK).is_some() {
        return bf16_wire_rank_check();
    }
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    for ranks in ["2", "4"] {
        let mut cmd = Command::new(&mpirun);
        cmd.args(["-n", ranks])
            .arg(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "bf16_wire_sums_agree_within_rounding",
                "--nocapture",
            ])
            .env(BF16_RANK_CHECK, "1");
        run_ok(cmd);
    }
}

/// One rank's part: 100,003 values over six orders of magnitude, different on every rank,
/// summed with bf16 on the wire. Every element is within bf16 rounding of the exact sum:
/// each input rounds with relative error at most 2^-8 (bf16 keeps 8 significant bits), the
/// fp32 sum adds at most N 2^-24 of the magnitudes, and the sum rounds once more by 2^-8, so
/// |got - exact| <= 2^-8 (sum |x_r| + |exact|) + 2^-20 sum |x_r|. Every rank holds the same
/// values, bit for bit; and rounding happened (some differ from the fp32 sum).
fn bf16_wire_rank_check() {
    let dist = sprtrain::dist::Dist::init(60.0).unwrap();
    let (rank, world) = (dist.topo.rank, dist.topo.world);
    assert!(world > 1, "launched without a world");
    let value = |r: usize, i: usize| -> f64 {
        let u = ((i * 2_654_435_761 + r * 7_919) % 10_007) as f64 / 10_007.0 - 0.5;
        u * 10f64.powi((i % 7) as i32 - 3)
    };
    let len = 100_003;
    let send: Vec<f32> = (0..len).map(|i| value(rank, i) as f32).collect();
    let mut got = vec![0f32; len];
    // SAFETY: `got` is used by nothing else until `wait` returns.
    let pending = unsafe {
        dist.start_allreduce_into("bf16 check".into(), send, &mut got, true)
            .unwrap()
    };
    pending.wait(&dist).unwrap();
    let mut rounded = 0;
    for (i, &g) in got.iter().enumerate() {
        let xs: Vec<f64> = (0..world).map(|r| value(r, i) as f32 as f64).collect();
        let exact: f64 = xs.iter().sum();
        let magnitude: f64 = xs.iter().map(|x| x.abs()).sum();
        let bound = 2f64.powi(-8) * (magnitude + exact.abs()) + 2f64.powi(-20) * magnitude;
        let err = (g as f64 - exact).abs();
        assert!(
            err <= bound,
            "rank {rank} element {i}: {g} vs {exact} (bound {bound:e})"
        );
        rounded += usize::from(g != exact as f32);
    }
    assert!(rounded > len / 10, "only {rounded} sums were rounded");
    let all = dist.all_gather_f32("bf16 results", got).unwrap();
    for (r, theirs) in all.iter().enumerate() {
        assert!(theirs == &all[0], "rank {r} holds other sums than rank 0");
    }
}
