//! transformers Trainer's conveniences: the best checkpoint as the final model
//! (`train.load_best_model_at_end`, kept by `save_total_limit`) and early stopping
//! (`eval.early_stopping_patience` and `threshold`, as EarlyStoppingCallback).
//!
//! The tiny BERT (dropout off) learns to tag places in 160 CoNLL sentences (a word rule, see
//! `common::write_conll`), so the held-out loss falls steadily; "best" is made to mean something other
//! than "last" by scoring the loss with `greater_is_better`: the best evaluation is then the
//! first, and every later one fails to improve.

mod common;

use std::path::{Path, PathBuf};

use common::{
    eval_results, fixtures, max_weight_diff, ok, sprtrain, weights, write_conll, RunConfig,
};
use serde_json::Value;

/// 12 steps of 8, evaluating every 2 steps.
fn config(dir: &Path, name: &str) -> (RunConfig, PathBuf) {
    let (data, eval) = (dir.join("train.conll"), dir.join("dev.conll"));
    write_conll(&data, 160, 1);
    write_conll(&eval, 40, 2);
    let out = dir.join(name);
    let c = RunConfig::new(&fixtures().join("train_parity_mlm"), &data, &out)
        .set("model.task", "token-cls")
        .set_path("data.eval_file", &eval)
        .set("train.max_steps", 12)
        .set("train.batch_size", 8)
        .set("train.learning_rate", 5e-3)
        .set("eval.strategy", "steps")
        .set("eval.steps", 2)
        .set("runtime.seed", 3);
    (c, out)
}

/// (step, eval_loss) of every evaluation in metrics.jsonl.
fn eval_losses(out: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter_map(|r| Some((r["step"].as_u64()?, r.get("eval_loss")?.as_f64()?)))
        .collect()
}

fn checkpoints(out: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(out)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    names.sort();
    names
}

#[test]
fn the_final_model_is_the_best_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (c, out) = config(tmp.path(), "best");
    let path = c
        .set("train.load_best_model_at_end", true)
        .set("train.save_total_limit", 1)
        .set("eval.metric_for_best_model", "loss")
        .set("eval.greater_is_better", true)
        .write(&tmp.path().join("best.toml"));
    ok(sprtrain().arg("--config").arg(&path).output().unwrap());
    let evals = eval_losses(&out);
    assert_eq!(evals.len(), 6, "{evals:?}");
    assert!(
        evals[0].1 > evals[5].1,
        "the held-out loss falls: {evals:?}"
    );
    let (best_step, best_loss) = evals
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap();
    assert_ne!(
        best_step, 12,
        "best must not be last for this test to mean anything"
    );
    // save_total_limit 1 keeps the best checkpoint besides the newest.
    let mut want = vec![
        format!("checkpoint-{best_step}"),
        "checkpoint-12".to_string(),
    ];
    want.sort();
    assert_eq!(checkpoints(&out), want);
    let best_dir = out.join(format!("checkpoint-{best_step}"));
    assert_eq!(max_weight_diff(&weights(&out), &weights(&best_dir)), 0.0);
    assert!(max_weight_diff(&weights(&out), &weights(&out.join("checkpoint-12"))) > 1e-4);
    let r = eval_results(&out);
    assert_eq!(r["eval_loss"].as_f64().unwrap(), best_loss, "{r}");
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint-12").join("trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["best_global_step"], best_step);
    assert_eq!(state["best_metric"].as_f64().unwrap(), best_loss);
}

#[test]
fn early_stopping_ends_training_after_patience_evaluations() {
    let tmp = tempfile::tempdir().unwrap();
    // Higher loss counts as better: evaluations at steps 4 and 6 do not improve on step 2's.
    let (c, out) = config(tmp.path(), "patience");
    let path = c
        .set("eval.early_stopping_patience", 2)
        .set("eval.greater_is_better", true)
        .write(&tmp.path().join("patience.toml"));
    let log = ok(sprtrain().arg("--config").arg(&path).output().unwrap());
    assert!(log.contains("early stopping at step 6"), "{log}");
    let steps: Vec<u64> = eval_losses(&out).iter().map(|e| e.0).collect();
    assert_eq!(steps, [2, 4, 6]);
    assert_eq!(checkpoints(&out), ["checkpoint-6"]);
    assert!(out.join("model.safetensors").is_file());
    assert_eq!(
        eval_results(&out)["epoch"].as_f64().map(|e| e > 0.0),
        Some(true)
    );

    // The right direction, but a threshold no evaluation can beat: improvements smaller than
    // it count as none, so training stops at the same point.
    let (c, out) = config(tmp.path(), "threshold");
    let path = c
        .set("eval.early_stopping_patience", 2)
        .set("eval.early_stopping_threshold", 10.0)
        .write(&tmp.path().join("threshold.toml"));
    ok(sprtrain().arg("--config").arg(&path).output().unwrap());
    let steps: Vec<u64> = eval_losses(&out).iter().map(|e| e.0).collect();
    assert_eq!(steps, [2, 4, 6]);

    // Without a threshold the falling loss always improves: all 12 steps run.
    let (c, out) = config(tmp.path(), "improving");
    let path = c
        .set("eval.early_stopping_patience", 2)
        .write(&tmp.path().join("improving.toml"));
    ok(sprtrain().arg("--config").arg(&path).output().unwrap());
    assert_eq!(eval_losses(&out).len(), 6, "{:?}", eval_losses(&out));
}

/// A metric the evaluation does not report is refused with the ones it does.
#[test]
fn an_unknown_best_metric_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (c, _) = config(tmp.path(), "unknown");
    let path = c
        .set("train.load_best_model_at_end", true)
        .set("eval.metric_for_best_model", "bleu")
        .write(&tmp.path().join("unknown.toml"));
    let run = sprtrain().arg("--config").arg(&path).output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("the evaluation has no \"eval_bleu\" (it has eval_LOC_f1"),
        "{stderr}"
    );
}
