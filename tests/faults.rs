//! Faults during a run: a kill at every step of a checkpoint save, a full disk, and the stop
//! signals schedulers send. Each run is checked against an uninterrupted one: whatever
//! happened, `--resume latest` continues from a complete checkpoint to the same weights.

mod common;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{
    fixtures, logged_steps, mpi_config, mpi_data, ok, rank_pid, require, require_mpirun, sprtrain,
    weight_values, write_sentences, RunConfig,
};

/// The files every checkpoint holds.
const CHECKPOINT_FILES: [&str; 6] = [
    "config.json",
    "model.safetensors",
    "optimizer.safetensors",
    "sprtrain.toml",
    "tokenizer.json",
    "trainer_state.json",
];

/// 4 steps of 8 examples on the tiny BERT classifier (no dropout), a checkpoint every 2 steps.
fn config(dir: &Path, out: &Path, extra: &[(&str, toml::Value)]) -> PathBuf {
    let data = dir.join("train.tsv");
    if !data.exists() {
        write_sentences(&data, 48, 9, |i, n| (n + i / 5) % 2);
    }
    let mut c = RunConfig::new(&fixtures().join("train_parity"), &data, out)
        .set("train.max_steps", 4)
        .set("train.batch_size", 8)
        .set("train.learning_rate", 1e-3)
        .set("train.warmup_steps", 1)
        .set("train.save_steps", 2)
        .set("runtime.seed", 5);
    for (key, value) in extra {
        c = c.set(key, value.clone());
    }
    c.write(&dir.join(format!(
        "{}.toml",
        out.file_name().unwrap().to_string_lossy()
    )))
}

fn train(config: &Path, args: &[&str], env: &[(&str, String)]) -> Output {
    sprtrain()
        .arg("--config")
        .arg(config)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap()
}

/// Each step's last logged loss (a resumed run logs again the steps after its checkpoint).
fn losses_by_step(out: &Path) -> BTreeMap<u64, f64> {
    common::train_losses(out).into_iter().collect()
}

/// The complete checkpoints in `out` (steps), checking that every directory named like a
/// checkpoint is complete.
fn complete_checkpoints(out: &Path) -> Vec<usize> {
    let mut steps = Vec::new();
    for entry in std::fs::read_dir(out).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(step) = name.strip_prefix("checkpoint-") else {
            continue;
        };
        for file in CHECKPOINT_FILES {
            assert!(
                entry.path().join(file).is_file(),
                "{name} has no {file}: a partial checkpoint under a complete one's name"
            );
        }
        let state: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(entry.path().join("trainer_state.json")).unwrap(),
        )
        .unwrap_or_else(|e| panic!("{name}/trainer_state.json: {e}"));
        assert_eq!(state["global_step"].to_string(), step);
        steps.push(step.parse().unwrap());
    }
    steps.sort();
    steps
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// A kill (SIGKILL) at every step of every save of a run — each file written, each rename,
/// each removal by `save_total_limit` = 1 — then `--resume latest`: the resumed run starts
/// from the newest complete checkpoint (never a partial one), ends with the uninterrupted
/// run's weights bitwise, and from the first complete save on there is always a checkpoint.
#[test]
fn a_kill_at_any_point_of_a_save_resumes_from_a_complete_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let limit = [("train.save_total_limit", toml::Value::Integer(1))];
    let full = tmp.path().join("full");
    ok(train(&config(tmp.path(), &full, &limit), &[], &[]));
    let want_weights = weight_values(&full);
    let want_losses = losses_by_step(&full);
    assert_eq!(complete_checkpoints(&full), [4]);

    let (mut kills, mut resumed_from) = (0, BTreeMap::<usize, usize>::new());
    let mut first_saved: Option<usize> = None;
    for n in 1.. {
        assert!(n < 200, "more fault points than any save sequence has");
        let out = tmp.path().join(format!("kill-{n}"));
        let c = config(tmp.path(), &out, &limit);
        let killed = train(&c, &[], &[("SPRTRAIN_FAULT_KILL_AT", n.to_string())]);
        if killed.status.success() {
            break; // n is past the last fault point of the run
        }
        assert_eq!(
            killed.status.signal(),
            Some(libc::SIGKILL),
            "run {n} failed otherwise: {}",
            stderr(&killed)
        );
        kills += 1;
        let saved = complete_checkpoints(&out);
        if first_saved.is_none() && !saved.is_empty() {
            first_saved = Some(n);
        }
        if first_saved.is_some() {
            assert!(
                !saved.is_empty(),
                "kill {n}: no complete checkpoint is left"
            );
        }
        let Some(&latest) = saved.last() else {
            continue; // killed before the first save was complete: nothing to resume
        };
        let resumed = train(&c, &["--resume", "latest"], &[]);
        let text = ok(resumed);
        assert!(
            text.contains(&format!("at step {latest}")),
            "kill {n}: {text}"
        );
        assert_eq!(
            weight_values(&out),
            want_weights,
            "kill {n}: resumed from checkpoint-{latest}, the final weights differ"
        );
        assert_eq!(losses_by_step(&out), want_losses, "kill {n}");
        // What the killed save left behind was tidied when the resumed run started.
        let hidden: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|name| name.starts_with('.'))
            .collect();
        assert!(hidden.is_empty(), "kill {n}: {hidden:?} left");
        *resumed_from.entry(latest).or_default() += 1;
        std::fs::remove_dir_all(&out).unwrap();
    }
    eprintln!("{kills} kills; resumed from checkpoint (step: times) {resumed_from:?}");
    // Both saves and the final model were hit: resumed from step 2 and from step 4.
    assert!(kills >= 20, "only {kills} fault points");
    assert!(resumed_from.contains_key(&2) && resumed_from.contains_key(&4));
}

/// A tmpfs of a given size mounted for one test, unmounted when dropped.
struct SmallDisk {
    dir: PathBuf,
}

impl SmallDisk {
    fn mount(dir: &Path, kib: u64) -> Option<SmallDisk> {
        std::fs::create_dir_all(dir).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
            .arg(dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        require(
            mounted.then_some(()),
            "cannot mount a tmpfs (the full-disk test needs root)",
        )?;
        Some(SmallDisk {
            dir: dir.to_path_buf(),
        })
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// Space a directory's files take on disk, in KiB.
fn disk_kib(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| e.metadata().unwrap().blocks() / 2)
        .sum()
}

/// The final model's files at the root of an output directory, in KiB.
fn final_model_kib(out: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    [
        "config.json",
        "model.safetensors",
        "sprtrain.toml",
        "tokenizer.json",
    ]
    .iter()
    .map(|f| std::fs::metadata(out.join(f)).unwrap().blocks() / 2)
    .sum()
}

/// A disk with room for the first checkpoint and the final model but not the second
/// checkpoint: with `train.on_save_error = "stop"` the run ends non-zero with one line naming
/// the disk error and checkpoint-2 intact (resuming from it gives the uninterrupted weights);
/// with "continue" it warns, trains to the end and writes the final model.
#[test]
fn a_full_disk_keeps_earlier_checkpoints_and_stops_or_continues_as_configured() {
    let tmp = tempfile::tempdir().unwrap();
    let full = tmp.path().join("full");
    ok(train(&config(tmp.path(), &full, &[]), &[], &[]));
    let checkpoint = disk_kib(&full.join("checkpoint-2"));
    // Room for checkpoint-2 and about half another (and the metrics log): checkpoint-4
    // cannot fit, the final model (about a third of a checkpoint: no optimizer moments) can.
    let size = checkpoint + checkpoint / 2 + 8;
    let model = final_model_kib(&full);
    assert!(
        model + 16 < checkpoint / 2,
        "checkpoint {checkpoint} KiB, model {model} KiB"
    );

    for mode in ["stop", "continue"] {
        let Some(disk) = SmallDisk::mount(&tmp.path().join(format!("disk-{mode}")), size) else {
            return;
        };
        let out = disk.dir.join("out");
        let c = config(
            tmp.path(),
            &out,
            &[("train.on_save_error", toml::Value::String(mode.into()))],
        );
        let run = train(&c, &[], &[]);
        let err = stderr(&run);
        assert_eq!(complete_checkpoints(&out), [2], "{mode}: {err}");
        for file in ["model.safetensors", "optimizer.safetensors"] {
            assert_eq!(
                std::fs::read(out.join("checkpoint-2").join(file)).unwrap(),
                std::fs::read(full.join("checkpoint-2").join(file)).unwrap(),
                "{mode}: checkpoint-2/{file} differs from the unconstrained run's"
            );
        }
        assert!(
            !out.join(".checkpoint-4.partial").exists(),
            "{mode}: the partial checkpoint was left on the full disk"
        );
        if mode == "stop" {
            assert!(!run.status.success(), "{err}");
            let lines: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
            assert_eq!(lines.len(), 1, "{err}");
            assert!(
                lines[0].starts_with("sprtrain: error: the checkpoint of step 4 was not saved")
                    && lines[0].contains("No space left on device"),
                "{err}"
            );
            // Nothing saved was lost: on a disk with room, the run resumes from checkpoint-2
            // to the uninterrupted run's weights.
            let moved = tmp.path().join("moved");
            copy_dir(&out, &moved);
            let c = config(tmp.path(), &moved, &[]);
            let text = ok(train(&c, &["--resume", "latest"], &[]));
            assert!(text.contains("at step 2"), "{text}");
            assert_eq!(weight_values(&moved), weight_values(&full));
        } else {
            let text = ok(run);
            assert!(
                text.contains("the checkpoint of step 4 was not saved")
                    && text.contains("No space left on device")
                    && text.contains("training goes on"),
                "{text}"
            );
            assert_eq!(weight_values(&out), weight_values(&full));
            let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
            assert!(log.contains("\"event\":\"save_failed\""), "{log}");
            assert_eq!(losses_by_step(&out), losses_by_step(&full));
        }
        drop(disk);
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Waits until `out`'s metrics log has at least `steps` loss records.
fn wait_for_steps(out: &Path, steps: usize, job: &mut std::process::Child) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while logged_steps(out) < steps {
        assert!(
            job.try_wait().unwrap().is_none(),
            "the run ended before the signal"
        );
        assert!(Instant::now() < deadline, "training never started");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits at most 30 s for `job` to end after a signal.
fn wait_30s(job: &mut std::process::Child, pids: &[i32]) -> (std::process::ExitStatus, Duration) {
    let sent = Instant::now();
    loop {
        if let Some(status) = job.try_wait().unwrap() {
            return (status, sent.elapsed());
        }
        if sent.elapsed() > Duration::from_secs(30) {
            for &pid in pids {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let _ = job.kill();
            panic!("the job outlived the signal by 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The step of the checkpoint a stopped run reported.
fn stopped_at(err: &str, signal: &str) -> usize {
    let line = err
        .lines()
        .find(|l| l.starts_with(&format!("sprtrain: stopped by {signal} after step ")))
        .unwrap_or_else(|| panic!("no stop line: {err}"));
    let step: usize = line
        .split_whitespace()
        .nth(6)
        .and_then(|s| s.trim_end_matches(';').parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(
        line.contains(&format!("checkpoint-{step}: continue with --resume latest")),
        "{line}"
    );
    step
}

/// SIGTERM to a training process: it saves a checkpoint at the next step boundary and exits
/// with 143; resumed, it ends with the uninterrupted run's weights, bitwise.
#[test]
fn sigterm_saves_at_the_next_step_and_the_resumed_run_equals_an_uninterrupted_one() {
    let tmp = tempfile::tempdir().unwrap();
    let long = [
        ("train.max_steps", toml::Value::Integer(300)),
        ("train.save_steps", toml::Value::Integer(0)),
    ];
    let full = tmp.path().join("full");
    ok(train(&config(tmp.path(), &full, &long), &[], &[]));

    let out = tmp.path().join("stopped");
    let c = config(tmp.path(), &out, &long);
    let mut job = sprtrain()
        .arg("--config")
        .arg(&c)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_steps(&out, 3, &mut job);
    let pid = job.id() as i32;
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let (status, took) = wait_30s(&mut job, &[pid]);
    let mut err = String::new();
    std::io::Read::read_to_string(&mut job.stderr.take().unwrap(), &mut err).unwrap();
    eprintln!("stopped {took:?} after SIGTERM, status {status}");
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{err}");
    let step = stopped_at(&err, "SIGTERM");
    assert!((3..300).contains(&step), "{err}");
    assert_eq!(complete_checkpoints(&out), [step]);
    assert!(
        !out.join("model.safetensors").exists(),
        "an interrupted run wrote a final model"
    );
    let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(log.contains("\"event\":\"interrupted\""), "{log}");

    let text = ok(train(&c, &["--resume", "latest"], &[]));
    assert!(text.contains(&format!("at step {step}")), "{text}");
    assert_eq!(weight_values(&out), weight_values(&full));
    assert_eq!(losses_by_step(&out), losses_by_step(&full));
}

/// SIGINT to rank 0 of a 2-rank job: rank 0 saves at the next step boundary and every rank
/// exits non-zero within 30 s; the job resumed under mpirun ends with the uninterrupted
/// job's weights (within 1e-6: the same sums in the same order).
#[test]
fn sigint_on_rank_0_stops_every_rank_after_a_checkpoint() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = mpi_data(tmp.path());
    // Long enough that the signal lands mid-run however late this process sees step 3 on a
    // busy machine (120 steps, about 0.2 s of training, once finished before it).
    let steps = 600;
    let (c_full, full) = mpi_config(tmp.path(), &data, "full", 4, 1, steps);
    let (c, out) = mpi_config(tmp.path(), &data, "stopped", 4, 1, steps);
    let mpi = |config: &Path, args: &[&str]| {
        let mut cmd = Command::new(&mpirun);
        cmd.args(["-n", "2", env!("CARGO_BIN_EXE_sprtrain"), "--config"])
            .arg(config)
            .args(args);
        cmd
    };
    ok(mpi(&c_full, &[]).output().unwrap());

    let mut job = mpi(&c, &[]).stderr(Stdio::piped()).spawn().unwrap();
    wait_for_steps(&out, 3, &mut job);
    let pids: Vec<i32> = (0..2).filter_map(|r| rank_pid(&c, r)).collect();
    assert_eq!(pids.len(), 2, "both ranks' processes");
    unsafe { libc::kill(pids[0], libc::SIGINT) };
    let (status, took) = wait_30s(&mut job, &pids);
    let mut err = String::new();
    std::io::Read::read_to_string(&mut job.stderr.take().unwrap(), &mut err).unwrap();
    eprintln!("job ended {took:?} after SIGINT to rank 0, status {status}");
    assert!(!status.success(), "{err}");
    assert!(rank_pid(&c, 0).is_none() && rank_pid(&c, 1).is_none());
    let step = stopped_at(&err, "SIGINT");
    assert!(step < steps, "{err}");
    assert_eq!(complete_checkpoints(&out), [step]);

    ok(mpi(&c, &["--resume", "latest"]).output().unwrap());
    let (a, b) = (weight_values(&out), weight_values(&full));
    let worst = a
        .iter()
        .zip(&b)
        .flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0f32, f32::max);
    assert!(worst <= 1e-6, "weights differ by {worst}");
}
