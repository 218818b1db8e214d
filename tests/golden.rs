//! Golden fixtures of the training order and of the checkpoint format.
//!
//! Exact resume and "N ranks == N-fold accumulation" rest on the seeded batch order, the
//! held-out split, and the dropout and masking streams; runs resume from checkpoints that
//! earlier binaries wrote. Both are pinned here against committed files, so a change that
//! alters which examples a run sees, which units it drops, which tokens it masks, or that
//! stops loading a checkpoint written before it, fails instead of passing every parity test.
//!
//! A change made on purpose re-blesses the fixtures and says so in docs/checkpoints.md:
//!
//!     SPRTRAIN_BLESS=1 cargo test --release --test golden
//!
//! Blessing rewrites `training_order.json` and the expected continuation of every committed
//! checkpoint; it writes a checkpoint only where none is committed for the current format, so
//! the checkpoints of earlier formats stay and keep being resumed.

mod common;

use std::path::{Path, PathBuf};

use common::{fixtures, ok, sprtrain, train_losses};
use serde_json::{json, Value};
use sprtrain::data::batching::{holdout_split, BatchPlan, Feature, Target};
use sprtrain::data::masking::{Masking, EVAL_KEY};
use sprtrain::models::layers::{dropout, seed_dropout};
use sprtrain::models::weights::read_safetensors;
use sprtrain::train::dropout_seed;
use tch::{Device, Kind, Tensor};

/// Set to 1 to rewrite the fixtures from this binary instead of checking against them.
const BLESS: &str = "SPRTRAIN_BLESS";

fn blessing() -> bool {
    std::env::var(BLESS).is_ok_and(|v| v == "1")
}

fn golden() -> PathBuf {
    fixtures().join("golden")
}

/// The first place where `want` and `got` differ, as a JSON path with both values.
fn first_difference(want: &Value, got: &Value, at: &str) -> Option<String> {
    match (want, got) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            keys.into_iter().find_map(|k| {
                let (x, y) = (
                    a.get(k).unwrap_or(&Value::Null),
                    b.get(k).unwrap_or(&Value::Null),
                );
                first_difference(x, y, &format!("{at}.{k}"))
            })
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (x, y))| first_difference(x, y, &format!("{at}[{i}]"))),
        _ if want == got => None,
        _ => Some(format!("{at}: fixture has {want}, this build gives {got}")),
    }
}

/// Pretty JSON with arrays of numbers or short strings on one line each, so a fixture reads
/// (and diffs) a micro-batch or a draw per line.
fn compact_json(value: &Value) -> String {
    let pretty = serde_json::to_string_pretty(value).unwrap();
    let flat = regex::Regex::new(
        r#"\[\s*((?:-?[0-9.e+-]+|"[01]*")(?:,\s*(?:-?[0-9.e+-]+|"[01]*"))*)\s*\]"#,
    )
    .unwrap();
    let one_line = flat.replace_all(&pretty, |c: &regex::Captures| {
        let items: Vec<&str> = c[1].split(',').map(str::trim).collect();
        format!("[{}]", items.join(", "))
    });
    one_line.into_owned() + "\n"
}

/// Checks `got` against the committed fixture `name`, or rewrites the fixture when blessing.
fn check_golden(name: &str, got: &Value) {
    let path = golden().join(name);
    if blessing() {
        std::fs::create_dir_all(golden()).unwrap();
        std::fs::write(&path, compact_json(got)).unwrap();
        eprintln!("blessed {}", path.display());
        return;
    }
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} ({BLESS}=1 writes it)", path.display()));
    let want: Value = serde_json::from_str(&text).unwrap();
    if let Some(diff) = first_difference(&want, got, "$") {
        panic!(
            "{}: the training order changed: {diff}.\nIf that is intended, rerun with {BLESS}=1 \
             and say why in docs/checkpoints.md (resumed runs and N-rank equivalence change with it).",
            path.display()
        );
    }
}

/// The order fixture's examples: 37 (so the last global batch is short), of lengths
/// 3..31 with ties (so length grouping's tie order is pinned too).
const EXAMPLES: usize = 37;
const SEED: u64 = 42;
const MICRO_BATCH: usize = 2;

fn example_lengths() -> Vec<usize> {
    (0..EXAMPLES).map(|i| 3 + (i * 7) % 29).collect()
}

/// One plan's first two global batches and last one of epochs 0 and 1, as each rank's
/// micro-batches of example indices.
fn plan_order(world: usize, accumulation: usize, group_by_length: bool, drop_last: bool) -> Value {
    let plan = BatchPlan {
        micro_batch: MICRO_BATCH,
        accumulation,
        world,
        seed: SEED,
        drop_last,
        group_by_length,
    };
    let lengths = example_lengths();
    let mut steps = Vec::new();
    for epoch in 0..2 {
        let batches = plan.epoch(&lengths, epoch);
        assert_eq!(batches.len(), plan.steps_per_epoch(EXAMPLES));
        let last = batches.len() - 1;
        for step in [0, 1, last] {
            let ranks: Vec<Vec<&[usize]>> = (0..world)
                .map(|rank| plan.micro_batches(&batches[step], rank))
                .collect();
            steps.push(json!({"epoch": epoch, "step": step, "ranks": ranks}));
        }
    }
    json!({
        "world": world,
        "accumulation": accumulation,
        "group_by_length": group_by_length,
        "drop_last": drop_last,
        "steps_per_epoch": plan.steps_per_epoch(EXAMPLES),
        "steps": steps,
    })
}

/// Which of 64 units the dropout stream keeps (p = 0.5), for its first two draws after being
/// seeded for (step, micro-batch), as '1' kept / '0' dropped.
fn dropout_draws(step: usize, micro: usize) -> Value {
    let stream_seed = dropout_seed(SEED, step, micro);
    seed_dropout(stream_seed);
    let draws: Vec<String> = (0..2)
        .map(|_| {
            let x = Tensor::ones([64], (Kind::Float, Device::Cpu));
            let kept = Vec::<bool>::try_from(dropout(&x, 0.5, true).ne(0.0)).unwrap();
            kept.iter().map(|&k| if k { '1' } else { '0' }).collect()
        })
        .collect();
    json!({"step": step, "micro": micro, "stream_seed": stream_seed, "kept": draws})
}

/// Masked-LM draws of one feature (the tiny WordPiece tokenizer's [CLS], 34 ids among which
/// some continue a word, [SEP]) for several (key, index), by token and by whole word.
fn masking_draws() -> Value {
    let tokenizer = fixtures()
        .join("parity")
        .join("bert-mlm")
        .join("tokenizer.json");
    let ids: Vec<i64> = std::iter::once(2)
        .chain((5..107).step_by(3))
        .chain(std::iter::once(3))
        .collect();
    let feature = Feature {
        type_ids: vec![0; ids.len()],
        input_ids: ids,
        target: Target::Masked,
    };
    let mut out = Vec::new();
    for whole_word in [false, true] {
        let masking = Masking::new(&tokenizer, 0.15, whole_word, SEED).unwrap();
        for (key, index) in [(0, 0), (0, 1), (1, 0), (7, 13), (EVAL_KEY, 5)] {
            let masked = masking.mask(&feature, key, index);
            let Target::Tokens(labels) = masked.target else {
                panic!("masking gives token labels")
            };
            out.push(json!({
                "whole_word": whole_word, "key": key, "index": index,
                "input_ids": masked.input_ids, "labels": labels,
            }));
        }
    }
    json!({"input_ids": feature.input_ids, "draws": out})
}

/// The example indices of the first micro-batches at 1, 2 and 4 ranks, with and without
/// accumulation and length grouping; the held-out split; the first draws of the dropout and
/// masking streams.
#[test]
fn the_training_order_is_the_committed_one() {
    let plans: Vec<Value> = [
        (1, 1, false, false),
        (1, 4, false, false),
        (2, 2, false, false),
        (4, 1, false, false),
        (1, 4, true, false),
        (2, 2, true, false),
        (4, 1, true, false),
        (2, 2, false, true),
    ]
    .into_iter()
    .map(|(w, a, g, d)| plan_order(w, a, g, d))
    .collect();
    let (_, held_out) = holdout_split(50, 0.2, SEED);
    let dropout: Vec<Value> = [(0, 0), (0, 1), (3, 0), (3, 5)]
        .into_iter()
        .map(|(s, m)| dropout_draws(s, m))
        .collect();
    let got = json!({
        "examples": EXAMPLES,
        "lengths": example_lengths(),
        "seed": SEED,
        "micro_batch": MICRO_BATCH,
        "plans": plans,
        "held_out_of_50_at_0.2": held_out,
        "dropout": dropout,
        "masking": masking_draws(),
    });
    check_golden("training_order.json", &got);
}

/// Where the committed checkpoints live: one directory per checkpoint format, each with the
/// checkpoint (`checkpoint-4`, as the binary of its time wrote it) and what resuming it gives
/// (`expected.json`: the losses of steps 5-8; `final.safetensors`: the final weights).
fn committed_checkpoints() -> PathBuf {
    golden().join("checkpoints")
}

/// Where the checkpoint of the format this build writes is committed.
fn current_format() -> String {
    format!("format-{}", sprtrain::checkpoint::manifest::FORMAT)
}

/// The run of `common::tiny_classifier_run`: the resumed half replays the seeded order, the
/// dropout masks and AdamW's state.
fn golden_run(dir: &Path, out: &Path) -> PathBuf {
    let name = out.file_name().unwrap().to_string_lossy().to_string();
    let data = common::tiny_classifier_data(dir);
    common::tiny_classifier_run(&data, out).write(&dir.join(format!("{name}.toml")))
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Writes this build's checkpoint of the golden run into `fixture` (blessing a new format)
/// and checks that resuming it gives the uninterrupted run's final weights, bitwise.
fn bless_checkpoint(dir: &Path, fixture: &Path) {
    let full = dir.join("full");
    ok(sprtrain()
        .args(["--config", golden_run(dir, &full).to_str().unwrap()])
        .output()
        .unwrap());
    copy_dir(&full.join("checkpoint-4"), &fixture.join("checkpoint-4"));
    let resumed = resume_committed(dir, fixture);
    assert_eq!(
        common::weight_values(&resumed),
        common::weight_values(&full),
        "the resumed golden run differs from the uninterrupted one"
    );
    eprintln!("blessed {}", fixture.join("checkpoint-4").display());
}

/// Resumes the committed checkpoint in `fixture` to step 8; returns the run's directory.
fn resume_committed(dir: &Path, fixture: &Path) -> PathBuf {
    let out = dir.join(format!(
        "resumed-{}",
        fixture.file_name().unwrap().to_string_lossy()
    ));
    copy_dir(&fixture.join("checkpoint-4"), &out.join("checkpoint-4"));
    let config = golden_run(dir, &out);
    let text = ok(sprtrain()
        .args(["--config", config.to_str().unwrap(), "--resume", "latest"])
        .output()
        .unwrap());
    assert!(
        text.contains("resumed from") && text.contains("at step 4"),
        "{}: {text}",
        fixture.display()
    );
    out
}

/// Every committed checkpoint, written by the binary of its time, resumes under this one to
/// the committed continuation.
///
/// Tolerances: the fixtures were made on one CPU, and the BLAS and oneDNN run other kernels
/// (AVX2, AVX-512, AMX) on others, so fp32 products may round differently. On one machine,
/// `runtime.fp32_gemm` = blas or onednn, and MKL and oneDNN held to AVX2 or SSE4.2, moved the
/// final weights by at most 7.5e-9 and left the losses equal; `runtime.seed` 12 instead of 11
/// (another order and other dropout masks) moves the weights by 1.9e-3 and the losses by up to
/// 2%. The bounds, 1e-6 on each weight and 1e-5 relative on each loss, sit between the two.
#[test]
fn committed_checkpoints_resume_to_the_committed_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let current = committed_checkpoints().join(current_format());
    if blessing() && !current.join("checkpoint-4").is_dir() {
        let scratch = tmp.path().join("bless");
        std::fs::create_dir(&scratch).unwrap();
        bless_checkpoint(&scratch, &current);
    }
    let mut fixtures: Vec<PathBuf> = std::fs::read_dir(committed_checkpoints())
        .unwrap_or_else(|e| panic!("{}: {e}", committed_checkpoints().display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("checkpoint-4").is_dir())
        .collect();
    fixtures.sort();
    assert!(
        fixtures.contains(&current),
        "no committed checkpoint of {} ({BLESS}=1 writes it)",
        current_format()
    );
    for fixture in &fixtures {
        let out = resume_committed(tmp.path(), fixture);
        let losses: Vec<(u64, f64)> = train_losses(&out);
        let expected = fixture.join("expected.json");
        let final_weights = fixture.join("final.safetensors");
        if blessing() {
            let record = json!({"losses": losses});
            std::fs::write(&expected, compact_json(&record)).unwrap();
            std::fs::copy(out.join("model.safetensors"), &final_weights).unwrap();
            eprintln!(
                "blessed {} and {}",
                expected.display(),
                final_weights.display()
            );
            continue;
        }
        check_continuation(fixture, &losses, &out);
    }
}

/// The resumed run's losses and final weights against the fixture's, within the tolerances
/// of [`committed_checkpoints_resume_to_the_committed_weights`].
fn check_continuation(fixture: &Path, losses: &[(u64, f64)], out: &Path) {
    let record: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("expected.json")).unwrap())
            .unwrap();
    let want: Vec<(u64, f64)> = serde_json::from_value(record["losses"].clone()).unwrap();
    assert_eq!(
        losses.iter().map(|l| l.0).collect::<Vec<_>>(),
        [5, 6, 7, 8],
        "{}: the resumed run logs steps 5-8",
        fixture.display()
    );
    for ((step, got), (_, want)) in losses.iter().zip(&want) {
        let rel = ((got - want) / want).abs();
        assert!(
            rel <= 1e-5,
            "{}: step {step}: loss {got} vs committed {want} ({rel:.2e} relative)",
            fixture.display()
        );
    }
    let mut want = read_safetensors(&fixture.join("final.safetensors")).unwrap();
    let mut got = read_safetensors(&out.join("model.safetensors")).unwrap();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    got.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        want.iter().map(|w| &w.0).collect::<Vec<_>>(),
        got.iter().map(|w| &w.0).collect::<Vec<_>>(),
        "{}: the final model's tensors",
        fixture.display()
    );
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        let diff = common::max_abs_diff(g, w);
        assert!(
            diff <= 1e-6,
            "{}: {name} differs from the committed final weights by {diff:.2e}",
            fixture.display()
        );
    }
}
