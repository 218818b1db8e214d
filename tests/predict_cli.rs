//! `sprtrain predict` black-box against transformers: tiny models saved by `save_pretrained`,
//! their tokenizer.json, inputs as JSON Lines; logits within 1e-4 of transformers' on the same
//! texts (transformers' tokenizer and padding on its side, ours on this side).

mod common;

use std::path::Path;

use common::{fixtures, require_minilm, sprtrain};
use serde_json::Value;

const TOL: f64 = 1e-4;

fn max_diff(a: &Value, b: &Value) -> f64 {
    let (a, b) = (a.as_array().unwrap(), b.as_array().unwrap());
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x.as_f64().unwrap() - y.as_f64().unwrap()).abs())
        .fold(0.0, f64::max)
}

fn run_predict(model: &Path, task: &str, input: &Path, extra: &[&str]) -> (Vec<Value>, String) {
    let out_dir = tempfile::tempdir().unwrap();
    let output = out_dir.path().join("out.jsonl");
    let run = sprtrain()
        .args(["predict", "--task", task, "--batch-size", "2", "--model"])
        .arg(model)
        .arg("--input")
        .arg(input)
        .arg("--output")
        .arg(&output)
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr).to_string();
    assert!(run.status.success(), "predict failed: {stderr}");
    let rows = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (rows, stderr)
}

fn check(case: &str) {
    let dir = fixtures().join("parity").join(case);
    let task = if case.ends_with("qa") {
        "qa"
    } else {
        "seq-cls"
    };
    let (rows, _) = run_predict(&dir, task, &dir.join("predict_input.jsonl"), &[]);
    let expected: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("predict_expected.json")).unwrap())
            .unwrap();
    assert_eq!(rows.len(), expected.len());
    let mut worst: f64 = 0.0;
    for (got, want) in rows.iter().zip(&expected) {
        if task == "qa" {
            worst = worst.max(max_diff(&got["start_logits"], &want["start_logits"]));
            worst = worst.max(max_diff(&got["end_logits"], &want["end_logits"]));
            assert!(got["answer"].is_string() && got["id"].is_string(), "{got}");
        } else {
            worst = worst.max(max_diff(&got["logits"], &want["logits"]));
        }
    }
    eprintln!("{case}: predict logits max abs diff {worst:e}");
    assert!(
        worst <= TOL,
        "{case}: logits differ from transformers by {worst:e}"
    );
    if case.ends_with("single") {
        // The label is the argmax, named through config.json's id2label.
        let logits: Vec<f64> = rows[0]["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let best = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap();
        assert_eq!(rows[0]["label_id"], best);
        assert_eq!(rows[0]["label"], format!("LABEL_{best}"));
    }
}

macro_rules! predict_tests {
    ($($test:ident => $case:literal),* $(,)?) => { $(#[test] fn $test() { check($case); })* };
}

predict_tests! {
    bert_seq_cls_single => "bert-seq-cls-single",
    bert_seq_cls_multi => "bert-seq-cls-multi",
    bert_seq_cls_regression => "bert-seq-cls-regression",
    bert_qa => "bert-qa",
    distilbert_seq_cls_single => "distilbert-seq-cls-single",
    distilbert_seq_cls_multi => "distilbert-seq-cls-multi",
    distilbert_seq_cls_regression => "distilbert-seq-cls-regression",
    distilbert_qa => "distilbert-qa",
    roberta_seq_cls_single => "roberta-seq-cls-single",
    roberta_seq_cls_multi => "roberta-seq-cls-multi",
    roberta_seq_cls_regression => "roberta-seq-cls-regression",
    roberta_qa => "roberta-qa",
}

/// A bare BertModel checkpoint (no `bert.` prefix) fine-tuned for classification: the prefix is
/// added, the pooler is used, the new classifier is reported in one line and seeded.
#[test]
fn minilm_gets_a_new_classifier_head() {
    let Some(dir) = require_minilm() else {
        return;
    };
    let input = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        input.path(),
        "{\"text\": \"a great film\"}\n{\"text\": \"dull\", \"id\": 7}\n",
    )
    .unwrap();
    let (a, stderr) = run_predict(&dir, "seq-cls", input.path(), &["--num-labels", "3"]);
    let new_lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("newly initialized"))
        .collect();
    assert_eq!(new_lines.len(), 1, "{stderr}");
    assert!(
        new_lines[0].contains("[classifier.bias, classifier.weight]"),
        "{stderr}"
    );
    assert!(!stderr.contains("were not used"), "{stderr}");
    assert_eq!(a[0]["logits"].as_array().unwrap().len(), 3);
    assert_eq!(a[1]["id"], 7);
    let (b, _) = run_predict(&dir, "seq-cls", input.path(), &["--num-labels", "3"]);
    assert_eq!(a, b, "the same seed must give the same new head");
}
