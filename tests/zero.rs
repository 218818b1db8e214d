//! ZeRO stages 1, 2 and 3 (`dist.zero_stage`) under `mpirun` (MPICH's, or Intel MPI's with
//! scripts/test_intel_mpi.sh): the same numbers as stage 0, checkpoints that any stage and
//! world size resume, and the bytes each stage puts on the wire. The MPI tests skip with a
//! message where no `mpirun` is on PATH.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{
    losses, max_rel_diff, max_weight_diff, mpi_config, mpi_data, require_mpirun, weights,
};
use sprtrain::dist::{allreduce_bytes, scatter_bytes};
use sprtrain::train::STEP_TOTALS;

const BIN: &str = env!("CARGO_BIN_EXE_sprtrain");

/// `ranks` processes (one without mpirun) running `config` with `--set` pairs `sets` (and
/// `--resume latest` where it is among them); the output, failing the test unless the run
/// succeeded.
fn train(mpirun: &str, ranks: usize, config: &Path, sets: &[String]) -> String {
    let mut cmd = if ranks > 1 {
        let mut c = Command::new(mpirun);
        c.args(["-n", &ranks.to_string(), BIN]);
        c
    } else {
        Command::new(BIN)
    };
    cmd.arg("--config").arg(config);
    let mut args = sets.iter();
    while let Some(s) = args.next() {
        match s.as_str() {
            "--resume" => cmd.args(["--resume", args.next().map_or("latest", |a| a.as_str())]),
            _ => cmd.args(["--set", s]),
        };
    }
    common::ok(cmd.output().unwrap())
}

/// Per-step losses within 1e-5 relative and final weights within 1e-5: the stages differ from
/// stage 0 only in summation order (stage 2 adds each micro-batch's sum into the shard, where
/// stage 0 sums the accumulated gradients once) and in the norm's accumulation (f64 over
/// shards instead of one fp32 norm), far below 1e-5 after 20 steps of AdamW at lr 1e-3.
fn assert_same_run(what: &str, got: &Path, want: &Path) {
    let (l, w) = (losses(got), losses(want));
    assert_eq!(l.len(), w.len(), "{what}");
    let worst = max_rel_diff(&l, &w);
    let wmax = max_weight_diff(&weights(got), &weights(want));
    eprintln!("{what}: per-step loss max relative difference {worst:e}, weights {wmax:e}");
    assert!(worst <= 1e-5, "{what}: losses {l:?} vs {w:?}");
    assert!(wmax <= 1e-5, "{what}: weights differ by {wmax:e}");
}

/// The share of the parameters whose optimizer state rank 0 keeps, from its start-up line.
fn kept_share(log: &str) -> f64 {
    let line = log
        .lines()
        .find(|l| l.contains("parameters' state"))
        .unwrap_or_else(|| panic!("no ZeRO line in:\n{log}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "keeps").unwrap();
    let kept: f64 = words[at + 1].parse().unwrap();
    let all: f64 = words[at + 3].parse().unwrap();
    kept / all
}

/// The tiny BERT classifier, 20 steps with 2-fold accumulation, at 2 and 4 ranks: stages 1
/// to 3 equal stage 0, the final evaluation's loss too (with many small buckets, so each rank's shard is spread over the
/// whole model), and rank 0 keeps state for 1/N of the parameters. Stage 3 drops the weights
/// other ranks own after each use (they read as zeros until gathered again), so a layer run
/// without its gathered weights would show in the losses.
#[test]
fn stages_1_to_3_equal_stage_0_on_an_encoder() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = mpi_data(tmp.path());
    for ranks in [2, 4] {
        let run = |stage: u8, extra: &[&str]| {
            let name = format!("r{ranks}-stage{stage}{}", extra.join("-").replace('=', ""));
            let (config, out) = mpi_config(tmp.path(), &data, &name, 2, 2, 20);
            let mut sets = vec![
                format!("dist.zero_stage={stage}"),
                "dist.bucket_mb=0.01".to_string(),
                // 41 evaluation rows in batches of 5: 4 and 5 batches on 2 ranks, 2 and 3 on 4.
                "eval.batch_size=5".to_string(),
            ];
            sets.extend(extra.iter().map(|s| s.to_string()));
            (train(&mpirun, ranks, &config, &sets), out)
        };
        let (_, base) = run(0, &[]);
        for stage in [1, 2, 3] {
            let (log, out) = run(stage, &[]);
            assert_same_run(&format!("{ranks} ranks, stage {stage}"), &out, &base);
            // The final evaluation (stage 3 gathers each layer as it runs, and a rank with a
            // batch fewer joins the others' gathers) gives the same metrics.
            let (got, want) = (common::eval_results(&out), common::eval_results(&base));
            let (g, w) = (got["eval_loss"].as_f64(), want["eval_loss"].as_f64());
            let rel = (g.unwrap() - w.unwrap()).abs() / w.unwrap().abs();
            assert!(
                rel <= 1e-5,
                "{ranks} ranks, stage {stage}: eval {got} vs {want}"
            );
            let share = kept_share(&log);
            eprintln!("{ranks} ranks, stage {stage}: rank 0 keeps {share:.4} of the state");
            // Each bucket's chunk is within one element of 1/N of it.
            assert!((share - 1.0 / ranks as f64).abs() < 0.01, "{share}");
        }
        if ranks == 2 {
            // bf16 on the wire: stage 1's reduce-scatter gives each rank the very bf16 sums
            // of its chunks that stage 0's allreduce gives it.
            let (_, bf0) = run(0, &["dist.reduce_dtype=bf16"]);
            let (_, bf1) = run(1, &["dist.reduce_dtype=bf16"]);
            assert_same_run("2 ranks, bf16 wire, stage 1", &bf1, &bf0);
            // Activation checkpointing composes: every micro-batch cut into stages and
            // recomputed, the buckets launched as backward completes them.
            let (_, ck) = run(2, &["train.gradient_checkpointing=true"]);
            assert_same_run("2 ranks, stage 2, activation checkpointing", &ck, &base);
            // Stage 3 gathers each layer again before its recomputation.
            let (_, ck3) = run(3, &["train.gradient_checkpointing=true"]);
            assert_same_run("2 ranks, stage 3, activation checkpointing", &ck3, &base);
        }
    }
}

/// A 12-step run of the tiny Llama on 120 lines of text (2 ranks, one micro-batch each).
fn llama_config(dir: &Path, name: &str, lora: bool) -> (PathBuf, PathBuf) {
    let text = dir.join("train.txt");
    common::write_numbered_lines(&text);
    let llama = common::fixtures().join("parity").join("llama-causal-lm");
    let out = dir.join(name);
    let mut config = common::RunConfig::new(&llama, &text, &out)
        .set("model.task", "causal-lm")
        .set("train.max_steps", 12)
        .set("train.batch_size", 3)
        .set("train.learning_rate", 3e-3)
        .set("train.warmup_steps", 2)
        .set("runtime.threads", 0)
        .set("runtime.seed", 3);
    if lora {
        config = config.set("lora.r", 4);
    }
    (config.write(&dir.join(format!("{name}.toml"))), out)
}

/// The tiny Llama (grouped-query attention, rotary positions, tied embeddings) at stages 2
/// and 3 equals stage 0 (stage 3 with activation checkpointing, so with the LM loss made a
/// chunk of logits at a time, and the tied embeddings' gradient added from it), and so does
/// LoRA at stages 1 to 3 (with activation checkpointing at 2), where only the adapters are
/// sharded.
/// LoRA's adapters are 896 values (see tests/mpi.rs), in one bucket: stage 1 sends a
/// reduce-scatter and an all-gather of them, as many bytes as stage 0's allreduce.
#[test]
fn stage_2_equals_stage_0_on_a_decoder_and_under_lora() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (c0, base) = llama_config(dir, "stage0", false);
    train(&mpirun, 2, &c0, &["dist.zero_stage=0".into()]);
    for stage in [2, 3] {
        let (c, out) = llama_config(dir, &format!("stage{stage}"), false);
        let checkpointing = format!("train.gradient_checkpointing={}", stage == 3);
        train(
            &mpirun,
            2,
            &c,
            &[format!("dist.zero_stage={stage}"), checkpointing],
        );
        assert_same_run(&format!("tiny Llama, 2 ranks, stage {stage}"), &out, &base);
    }

    let adapters = |out: &Path| {
        let mut w =
            sprtrain::models::weights::read_safetensors(&out.join("adapter_model.safetensors"))
                .unwrap();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        w
    };
    let (l0, lora0) = llama_config(dir, "lora-stage0", true);
    train(&mpirun, 2, &l0, &[]);
    let totals = allreduce_bytes(STEP_TOTALS, 8, 2);
    for stage in [1u8, 2, 3] {
        let (c, out) = llama_config(dir, &format!("lora-stage{stage}"), true);
        // Stage 2 with activation checkpointing too (LoRA's frozen embeddings end the
        // recomputation a stage early).
        let checkpointing = format!("train.gradient_checkpointing={}", stage == 2);
        train(
            &mpirun,
            2,
            &c,
            &[format!("dist.zero_stage={stage}"), checkpointing],
        );
        let (l, w) = (losses(&out), losses(&lora0));
        let worst = max_rel_diff(&l, &w);
        let wmax = max_weight_diff(&adapters(&out), &adapters(&lora0));
        eprintln!("LoRA, stage {stage}: losses {worst:e}, adapters {wmax:e}");
        assert!(worst <= 1e-5 && wmax <= 1e-5, "{l:?} vs {w:?}; {wmax:e}");
        // Stage 3 gathers the first layer's adapters twice (forward, backward) and the last
        // layer's once (kept from forward into backward), where stage 1 gathers each once: the
        // 2 layers' adapters are the same size.
        let want = match stage {
            3 => 5 * scatter_bytes(896, 4, 2) / 2 + totals,
            _ => 2 * scatter_bytes(896, 4, 2) + totals,
        };
        let sent = common::bytes_per_step(&out);
        assert_eq!(sent.len(), 12);
        assert!(sent.iter().all(|&b| b == want as f64), "{sent:?} vs {want}");
    }
    assert_eq!(
        scatter_bytes(896, 4, 2) * 2,
        allreduce_bytes(896, 4, 2),
        "stage 1 moves what stage 0 moves"
    );
}

/// Checkpoints hold the whole optimizer state at every stage, so a run saved at stage 2 on 2
/// ranks continues at stage 0 on 1 rank (2-fold accumulation), one saved at stage 0 on 1
/// rank continues at stage 1 on 2 ranks, and one saved at stage 3 continues at stage 0: per-step losses and final weights equal the
/// uninterrupted run's within 1e-5 (the summation-order difference between the layouts).
#[test]
fn a_checkpoint_resumes_at_another_stage_and_world_size() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = mpi_data(tmp.path());
    // (saved by: ranks, accumulation, stage) -> (resumed by: ranks, accumulation, stage), and
    // the largest weight file saved (the tiny model's 87 KB in 30 KB shards: stage 3 streams
    // them as its buckets are gathered).
    for ((r1, a1, s1), (r2, a2, s2), shard) in [
        ((2, 1, 2), (1, 2, 0), "5GB"),
        ((1, 2, 0), (2, 1, 1), "5GB"),
        ((2, 1, 3), (1, 2, 0), "5GB"),
        ((2, 1, 3), (1, 2, 0), "30KB"),
    ] {
        let name = format!("{r1}x{a1}-stage{s1}-then-{r2}x{a2}-stage{s2}-{shard}");
        let (full_cfg, full) = mpi_config(tmp.path(), &data, &format!("{name}-full"), 4, a1, 8);
        let sets = |stage: u8| {
            vec![
                "train.save_steps=4".to_string(),
                format!("dist.zero_stage={stage}"),
                "dist.bucket_mb=0.01".to_string(),
                format!("train.save_max_shard_size={shard}"),
            ]
        };
        train(&mpirun, r1, &full_cfg, &sets(s1));
        for dir in [full.clone(), full.join("checkpoint-4")] {
            let files = common::weight_files(&dir);
            let sharded = files.len() > 1;
            assert_eq!(sharded, shard == "30KB", "{name}: {files:?}");
            assert!(files.iter().all(|f| f.is_file()), "{name}: {files:?}");
        }
        let saved = sprtrain::models::weights::read_safetensors(
            &full.join("checkpoint-4").join("optimizer.safetensors"),
        )
        .unwrap();
        let params: i64 = weights(&full).iter().map(|(_, t)| t.numel() as i64).sum();
        for (moment, t) in &saved {
            assert_eq!(t.numel() as i64, params, "{name}: {moment} saved whole");
        }
        let (part_cfg, part) = mpi_config(tmp.path(), &data, &format!("{name}-part"), 4, a2, 8);
        common::only_checkpoint(&full, 4, &part);
        let mut resume = sets(s2);
        resume.extend(["--resume".to_string(), "latest".to_string()]);
        train(&mpirun, r2, &part_cfg, &resume);
        common::assert_resumed_like(&name, &full, &part, 4);
    }
}

/// A stage outside 0-3 and ZeRO over the TCP ring are refused before anything runs, with one
/// line naming the key.
#[test]
fn bad_zero_settings_get_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let data = mpi_data(tmp.path());
    let (config, out) = mpi_config(tmp.path(), &data, "bad", 4, 1, 2);
    for (sets, want) in [
        (
            vec!["dist.zero_stage=7"],
            "dist.zero_stage = 7: must be 0, 1, 2 or 3",
        ),
        (
            vec!["dist.zero_stage=3", "dist.transport=tcp"],
            "dist.zero_stage = 3: ZeRO's reduce-scatter and all-gather run over MPI; set dist.transport = \"mpi\"",
        ),
    ] {
        let mut cmd = Command::new(BIN);
        cmd.arg("--config").arg(&config);
        for s in &sets {
            cmd.args(["--set", s]);
        }
        let run = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success(), "{sets:?} was accepted");
        assert!(stderr.contains(want), "{sets:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(!out.exists(), "{sets:?} wrote {}", out.display());
    }
}
