//! `sprtrain --config` with `model.task = "qa"` on a tiny BERT: run_qa.py's windows train the
//! span head, evaluation extracts answers and scores them with SQuAD EM/F1 (predictions.json,
//! nbest_predictions.json), and `sprtrain eval` reproduces the final evaluation from the saved
//! model exactly.

mod common;

use std::path::Path;

use common::{fixtures, ok, sprtrain, write_squad, RunConfig};
use serde_json::Value;

fn config(dir: &Path) -> std::path::PathBuf {
    let data = dir.join("squad.json");
    write_squad(&data, 30);
    RunConfig::new(&fixtures().join("parity/bert-qa"), &data, &dir.join("out"))
        .set("model.task", "qa")
        .set("data.eval_split", 0.2)
        .set("data.group_by_length", true)
        .set("qa.doc_stride", 8)
        .set("train.epochs", 40)
        .set("train.batch_size", 8)
        .set("train.learning_rate", 3e-3)
        .set("train.warmup_ratio", 0.1)
        .set("train.logging_steps", 10)
        .set("eval.batch_size", 16)
        .set("runtime.seed", 3)
        .write(&dir.join("qa.toml"))
}

fn read(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn qa_training_learns_spans_and_eval_reproduces_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path());
    let out = tmp.path().join("out");
    let before = tmp.path().join("before");
    // The untrained model (random QA head) as the baseline.
    ok(sprtrain()
        .args(["eval", "--config"])
        .arg(&cfg)
        .arg("--model")
        .arg(fixtures().join("parity/bert-qa"))
        .arg("--output")
        .arg(&before)
        .output()
        .unwrap());
    let baseline = read(&before.join("eval_results.json"));
    ok(sprtrain().arg("--config").arg(&cfg).output().unwrap());
    let trained = read(&out.join("eval_results.json"));
    let (f1_before, f1_after) = (
        baseline["eval_f1"].as_f64().unwrap(),
        trained["eval_f1"].as_f64().unwrap(),
    );
    assert!(
        f1_after > f1_before + 30.0 && f1_after > 60.0,
        "F1 {f1_before:.1} -> {f1_after:.1}"
    );
    assert!(trained["eval_loss"].as_f64().unwrap() < baseline["eval_loss"].as_f64().unwrap());

    // Every held-out question answered, with its n-best list.
    let predictions = read(&out.join("predictions.json"));
    let nbest = read(&out.join("nbest_predictions.json"));
    let ids: Vec<&String> = predictions.as_object().unwrap().keys().collect();
    assert_eq!(ids.len(), 18, "6 of 30 articles held out, 3 questions each");
    for id in &ids {
        let list = nbest[id.as_str()].as_array().unwrap();
        assert!(!list.is_empty() && list.len() <= 20);
        assert_eq!(list[0]["text"], predictions[id.as_str()]);
    }

    // `sprtrain eval` on the saved model gives the same metrics and answers.
    let again = tmp.path().join("again");
    ok(sprtrain()
        .args(["eval", "--config"])
        .arg(&cfg)
        .arg("--output")
        .arg(&again)
        .output()
        .unwrap());
    let reproduced = read(&again.join("eval_results.json"));
    for (k, v) in trained.as_object().unwrap() {
        if k == "epoch" {
            continue;
        }
        let (a, b) = (v.as_f64().unwrap(), reproduced[k].as_f64().unwrap());
        assert!((a - b).abs() < 1e-9, "{k}: {a} vs {b}");
    }
    assert_eq!(read(&again.join("predictions.json")), predictions);
}

#[test]
fn qa_runs_without_evaluation_data_and_eval_says_what_is_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(tmp.path());
    let out = sprtrain()
        .arg("--config")
        .arg(&cfg)
        .args(["--set", "data.eval_split=0.0", "--set", "train.max_steps=2"])
        .output()
        .unwrap();
    ok(out);
    let out = sprtrain()
        .args(["eval", "--config"])
        .arg(&cfg)
        .args(["--set", "data.eval_split=0.0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("no evaluation data"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}
