//! Data parallelism under `mpirun -n 2` (MPICH's, or Intel MPI's with scripts/test_intel_mpi.sh).
//! Each test launches the job itself and checks the job's result; they skip with a message
//! where no `mpirun` is on PATH.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{
    eval_results, logged_steps, losses, max_rel_diff, max_weight_diff, mpi_config, mpi_data,
    only_checkpoint, rank_pid, require_mpirun, run_ok, weight_values, weights,
};

const BIN: &str = env!("CARGO_BIN_EXE_sprtrain");

/// Two ranks with batch B against one rank with batch 2B, and against one rank with batch B and
/// accumulation 2: per-step losses within 1e-5 relative and final weights within 1e-5 (fp32;
/// the runs differ only in summation order and padding length).
#[test]
fn two_ranks_equal_one_rank_with_double_batch_or_accumulation() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = mpi_data(tmp.path());
    let (c2, out2) = mpi_config(tmp.path(), &data, "two-ranks", 4, 1, 30);
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
    let (cb, outb) = mpi_config(tmp.path(), &data, "small-buckets", 4, 1, 30);
    let mut cmd = Command::new(&mpirun);
    cmd.args(["-n", "2", BIN, "--config"])
        .arg(&cb)
        .args(["--set", "dist.bucket_mb=0.01"]);
    run_ok(cmd);
    assert_eq!(losses(&outb), two.0, "bucketing changed the run");
    // The TCP ring (over loopback here), with the small buckets: two ranks' sums are a + b
    // over the ring as over MPI, so again the very same run.
    let (ct, outt) = mpi_config(tmp.path(), &data, "tcp-ring", 4, 1, 30);
    let mut cmd = Command::new(&mpirun);
    cmd.args(["-n", "2", BIN, "--config"]).arg(&ct).args([
        "--set",
        "dist.bucket_mb=0.01",
        "--set",
        "dist.transport=tcp",
    ]);
    run_ok(cmd);
    assert_eq!(losses(&outt), two.0, "the TCP ring changed the run");
    assert!(
        weight_values(&outt) == weight_values(&out2),
        "the TCP ring changed the weights"
    );
    // bf16 on the wire: the same run to bf16 rounding of the gradients.
    let (cf, outf) = mpi_config(tmp.path(), &data, "bf16-wire", 4, 1, 30);
    let mut cmd = Command::new(&mpirun);
    cmd.args(["-n", "2", BIN, "--config"])
        .arg(&cf)
        .args(["--set", "dist.reduce_dtype=bf16"]);
    run_ok(cmd);
    let bf = losses(&outf);
    let worst = max_rel_diff(&bf, &two.0);
    eprintln!("bf16 reduction: per-step loss max relative difference {worst:e}");
    assert!(worst > 0.0 && worst < 1e-2, "bf16 reduction: {worst}");

    for (name, batch, accum) in [("double-batch", 8, 1), ("accumulation", 4, 2)] {
        let (c1, out1) = mpi_config(tmp.path(), &data, name, batch, accum, 30);
        let mut cmd = Command::new(BIN);
        cmd.arg("--config").arg(&c1);
        run_ok(cmd);
        let one = (losses(&out1), weights(&out1));
        let worst = max_rel_diff(&one.0, &two.0);
        eprintln!("{name}: per-step loss max relative difference {worst:e}");
        assert!(worst <= 1e-5, "{name}: losses {:?} vs {:?}", one.0, two.0);
        let wmax = max_weight_diff(&one.1, &two.1);
        eprintln!("{name}: final weights max abs difference {wmax:e}");
        assert!(wmax <= 1e-5, "{name}: weights differ by {wmax}");
        // Evaluation sharded over two ranks and gathered equals one rank's.
        let (e1, e2) = (eval_results(&out1), eval_results(&out2));
        assert_eq!(e1["eval_accuracy"], e2["eval_accuracy"], "{e1} vs {e2}");
        let dl = (e1["eval_loss"].as_f64().unwrap() - e2["eval_loss"].as_f64().unwrap()).abs();
        eprintln!(
            "{name}: eval accuracy {} on both, eval loss differs by {dl:e}",
            e1["eval_accuracy"]
        );
        assert!(dl <= 1e-5);
    }
}

/// Trains a language model on 120 lines of text as 2 ranks and as 1 rank with 2-fold
/// accumulation; checks per-step losses and final weights within 1e-5, a falling loss and
/// the same held-out loss. Returns the text's directory and a config writer for more runs.
fn lm_two_ranks_equal_one_rank(
    mpirun: &str,
    model: &Path,
    task: &str,
) -> (tempfile::TempDir, impl Fn(&str, i64) -> (PathBuf, PathBuf)) {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("train.txt");
    common::write_numbered_lines(&text);
    let dir = tmp.path().to_path_buf();
    let (model, task_name) = (model.to_path_buf(), task.to_string());
    let config = move |name: &str, accum: i64| {
        let out = dir.join(name);
        let path = common::RunConfig::new(&model, &text, &out)
            .set("model.task", task_name.as_str())
            .set("data.eval_split", 0.1)
            .set("train.max_steps", 12)
            .set("train.batch_size", 3)
            .set("train.gradient_accumulation_steps", accum)
            .set("train.learning_rate", 3e-3)
            .set("train.warmup_steps", 2)
            .set("runtime.threads", 0)
            .set("runtime.seed", 3)
            .write(&dir.join(format!("{name}.toml")));
        (path, out)
    };
    let (c2, out2) = config("two-ranks", 1);
    let mut cmd = Command::new(mpirun);
    cmd.args(["-n", "2", BIN, "--config"]).arg(&c2);
    run_ok(cmd);
    let (c1, out1) = config("accumulation", 2);
    let mut cmd = Command::new(BIN);
    cmd.arg("--config").arg(&c1);
    run_ok(cmd);
    let (l1, l2) = (losses(&out1), losses(&out2));
    assert_eq!(l1.len(), 12);
    assert!(l1[0] - l1[11] > 0.1, "the loss must fall: {l1:?}");
    let worst = max_rel_diff(&l1, &l2);
    eprintln!("{task}: per-step loss max relative difference {worst:e}");
    assert!(worst <= 1e-5, "{l1:?} vs {l2:?}");
    let wmax = max_weight_diff(&weights(&out1), &weights(&out2));
    eprintln!("{task}: final weights max abs difference {wmax:e}");
    assert!(wmax <= 1e-5);
    let eval = |o: &Path| eval_results(o)["eval_loss"].as_f64().unwrap();
    assert!((eval(&out1) - eval(&out2)).abs() <= 1e-5);
    (tmp, config)
}

/// Causal-LM training (the tiny Llama: grouped-query attention, rotary positions) on packed
/// text is data-parallel like the encoders: 2 ranks equal 1 rank with 2-fold accumulation.
#[test]
fn causal_lm_two_ranks_equal_one_rank_with_accumulation() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let llama = common::fixtures().join("parity").join("llama-causal-lm");
    let (_tmp, config) = lm_two_ranks_equal_one_rank(&mpirun, &llama, "causal-lm");

    // LoRA: only the adapters' gradients cross the wire (q_proj and v_proj of 2 layers, r 4:
    // 2 x (4 x 32 + 32 x 4) + 2 x (4 x 32 + 16 x 4) = 896 values), plus the step's two totals.
    let (cl, outl) = config("lora", 1);
    let mut cmd = Command::new(&mpirun);
    cmd.args(["-n", "2", BIN, "--config"])
        .arg(&cl)
        .args(["--set", "lora.r=4"]);
    run_ok(cmd);
    let sent = common::bytes_per_step(&outl);
    let want = sprtrain::dist::allreduce_bytes(896, 4, 2)
        + sprtrain::dist::allreduce_bytes(sprtrain::train::STEP_TOTALS, 8, 2);
    assert_eq!(sent.len(), 12);
    assert!(sent.iter().all(|&b| b == want as f64), "{sent:?} vs {want}");
}

/// Masked-LM training (the tiny BERT, dropout off): the masks depend on the step and the
/// example, not on the rank that batches it, so 2 ranks equal 1 rank with 2-fold
/// accumulation as for every other task.
#[test]
fn masked_lm_two_ranks_equal_one_rank_with_accumulation() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let bert = common::fixtures().join("train_parity_mlm");
    let _ = lm_two_ranks_equal_one_rank(&mpirun, &bert, "mlm");
}

/// A run saved under 2 ranks continues under 1 rank with 2-fold accumulation, and one saved
/// under 1 rank continues under 2: the same global batches and dropout masks, so per-step
/// losses and final weights equal the uninterrupted run's (within 1e-5, the summation-order
/// difference between the two layouts). A changed global batch is refused, unless allowed.
#[test]
fn resume_at_another_world_size_continues_exactly() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = mpi_data(tmp.path());
    let train = |config: &Path, ranks: usize, extra: &[&str]| {
        let mut cmd = if ranks > 1 {
            let mut c = Command::new(&mpirun);
            c.args(["-n", &ranks.to_string(), BIN]);
            c
        } else {
            Command::new(BIN)
        };
        cmd.arg("--config")
            .arg(config)
            .args(["--set", "train.save_steps=4"])
            .args(extra);
        cmd.output().unwrap()
    };
    // (saved by: ranks, accumulation) -> (resumed by: ranks, accumulation)
    for ((r1, a1), (r2, a2)) in [((2, 1), (1, 2)), ((1, 2), (2, 1))] {
        let name = format!("{r1}x{a1}-then-{r2}x{a2}");
        let (full_cfg, full) = mpi_config(tmp.path(), &data, &format!("{name}-full"), 4, a1, 8);
        common::ok(train(&full_cfg, r1, &[]));
        let (part_cfg, part) = mpi_config(tmp.path(), &data, &format!("{name}-part"), 4, a2, 8);
        only_checkpoint(&full, 4, &part);
        common::ok(train(&part_cfg, r2, &["--resume", "latest"]));
        common::assert_resumed_like(&name, &full, &part, 4);
    }

    // One process without accumulation would take 4 examples a step where the run took 8.
    let (full_cfg, full) = mpi_config(tmp.path(), &data, "saved", 4, 1, 8);
    common::ok(train(&full_cfg, 2, &[]));
    let (part_cfg, part) = mpi_config(tmp.path(), &data, "changed", 4, 1, 8);
    only_checkpoint(&full, 4, &part);
    let out = train(&part_cfg, 1, &["--resume", "latest"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("the checkpoint was trained with a global batch of 8 examples per step (2 process(es)); this run's is 4 (train.batch_size 4 x train.gradient_accumulation_steps 1 x 1 process(es))"),
        "{stderr}"
    );
    let allowed = train(
        &part_cfg,
        1,
        &[
            "--resume",
            "latest",
            "--set",
            "train.allow_global_batch_change=true",
        ],
    );
    let log = common::ok(allowed);
    assert!(
        log.contains("continuing after the 32 examples of epoch 0 already seen"),
        "{log}"
    );
}

/// Ranks started with different configs (an MPMD launch, --set on rank 1 only) all stop with an
/// error naming the key and the ranks, fast, never hanging.
#[test]
fn mismatched_configs_stop_every_rank() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = mpi_data(tmp.path());
    let (c, _) = mpi_config(tmp.path(), &data, "mpmd", 4, 1, 5);
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
    let data = mpi_data(tmp.path());
    let (c, out) = mpi_config(tmp.path(), &data, name, 4, 1, 1_000_000);
    let mut job = Command::new(mpirun)
        .args(["-n", "2", BIN, "--config"])
        .arg(&c)
        .args(extra)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while logged_steps(&out) < 3 {
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
    // mpirun may return while the kernel still tears rank 0 down (a SIGKILLed process keeps
    // its /proc entry until its memory is freed): allow it a few seconds to go.
    let gone_by = Instant::now() + Duration::from_secs(10);
    while rank_pid(&c, 0).is_some() {
        assert!(
            Instant::now() < gone_by,
            "rank 0 is still running 10 s after the job ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
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

/// bf16 on the wire (reduce-scatter, fp32 sums, all-gather) at 2 and 4 ranks: the test runs
/// itself under mpirun, and each rank checks its own result (see `bf16_wire_rank_check`).
#[test]
fn bf16_wire_sums_agree_within_rounding() {
    if std::env::var_os(common::BF16_RANK_CHECK).is_some() {
        return common::bf16_wire_rank_check();
    }
    each_rank_checks(
        "bf16_wire_sums_agree_within_rounding",
        common::BF16_RANK_CHECK,
    );
}

/// Runs test `name` of this binary itself under `mpirun -n 2` and `-n 4`, with `marker` set
/// so that every rank runs its own check; skips where there is no mpirun.
fn each_rank_checks(name: &str, marker: &str) {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    for ranks in ["2", "4"] {
        let mut cmd = Command::new(&mpirun);
        cmd.args(["-n", ranks])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture"])
            .env(marker, "1");
        run_ok(cmd);
    }
}

/// The collectives that write in place, with the gradient sums on the TCP ring (loopback
/// here), at 2 and 4 ranks: each rank checks its own results (`common::in_place_rank_check`).
#[test]
fn in_place_broadcast_and_ring_sums_are_exact() {
    if std::env::var_os(common::IN_PLACE_RANK_CHECK).is_some() {
        return common::in_place_rank_check();
    }
    each_rank_checks(
        "in_place_broadcast_and_ring_sums_are_exact",
        common::IN_PLACE_RANK_CHECK,
    );
}

/// The `placement` line `sprtrain env` prints for each rank, by rank.
fn placements(stdout: &str) -> Vec<String> {
    let mut lines: Vec<(usize, String)> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("placement"))
        .map(|l| l.trim().to_string())
        .filter_map(|l| Some((l.strip_prefix("rank ")?.split('/').next()?.parse().ok()?, l)))
        .collect();
    lines.sort();
    lines.into_iter().map(|(_, l)| l).collect()
}

/// The launcher owns the binding: two ranks that start bound to one CPU each (by taskset, and
/// under Intel MPI by its default pinning, as `srun --cpu-bind=cores` or `mpirun -bind-to
/// core` start them) keep that CPU, with one thread each and no pinning of sprtrain's own;
/// started unbound, the same two ranks split the node's physical cores between them and pin
/// to their share.
#[test]
fn ranks_keep_the_launchers_binding_and_split_an_unbound_node() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let cpus = sprtrain::runtime::placement::allowed_cpus();
    if common::require((cpus.len() >= 2).then_some(()), "fewer than 2 CPUs").is_none() {
        return;
    }
    let (a, b) = (cpus[0], cpus[1]);
    let script = format!(
        "if [ \"$PMI_RANK\" = 0 ]; then c={a}; else c={b}; fi; exec taskset -c $c {BIN} env"
    );
    let env = |args: &[&str], intel_pin: Option<&str>| {
        let mut cmd = Command::new(&mpirun);
        cmd.args(["-n", "2"]).args(args);
        match intel_pin {
            Some(v) => cmd.env("I_MPI_PIN", v),
            None => cmd.env_remove("I_MPI_PIN"),
        };
        common::ok(cmd.output().unwrap())
    };
    check_bound(&env(&["sh", "-c", &script], Some("0")), a, b);
    let version = Command::new(&mpirun).arg("--version").output().unwrap();
    if String::from_utf8_lossy(&version.stdout).contains("Intel") {
        // Intel MPI pins each rank to its own domain by default: one CPU each here.
        check_bound(&env(&[BIN, "env"], None), a, b);
    }

    // Unbound: I_MPI_PIN=0 turns Intel MPI's default pinning off (MPICH pins nothing).
    let text = env(&[BIN, "env"], Some("0"));
    let split = placements(&text);
    assert_eq!(split.len(), 2, "{text}");
    let cores = sprtrain::runtime::placement::physical_cores();
    let share = |rank: usize| -> Vec<usize> {
        if cores.len() < 2 {
            vec![cores[0]]
        } else {
            let per = cores.len() / 2;
            cores[rank * per..(rank + 1) * per].to_vec()
        }
    };
    for (rank, line) in split.iter().enumerate() {
        let n = share(rank).len();
        let want = format!(
            "cores {}, split by sprtrain, pinned, {} threads",
            sprtrain::runtime::placement::cpu_ranges(&share(rank)),
            if n > 2 { n - 1 } else { n }
        );
        assert!(line.ends_with(&want), "{line} (want {want})");
    }
}

/// Each rank's placement line names its own CPU (`a` for rank 0, `b` for rank 1), bound by
/// the launcher, with one thread.
fn check_bound(text: &str, a: usize, b: usize) {
    let bound = placements(text);
    assert_eq!(bound.len(), 2, "{text}");
    for (rank, (line, cpu)) in bound.iter().zip([a, b]).enumerate() {
        assert!(
            line.ends_with(&format!(
                "(local {rank}/2): cores {cpu}, bound by the launcher, 1 threads"
            )),
            "{line}"
        );
    }
}
