//! `train.report_to = ["tensorboard"]`: the event files a run writes are read back by
//! TensorBoard's own event reader (the `tensorboard` package in the reference venv), and
//! every logged value equals metrics.jsonl's (as f32, the precision of TensorBoard scalars).

mod common;

use common::{fixtures, ok, require_reference_python, sprtrain, write_conll, RunConfig};
use serde_json::Value;

const READER: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1])
acc.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}))
"#;

#[test]
fn tensorboard_reads_back_every_logged_value() {
    let Some(python) = require_reference_python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let (train, eval) = (tmp.path().join("train.conll"), tmp.path().join("dev.conll"));
    write_conll(&train, 40, 1);
    write_conll(&eval, 10, 2);
    let out = tmp.path().join("run");
    let config = RunConfig::new(&fixtures().join("train_parity_mlm"), &train, &out)
        .set("model.task", "token-cls")
        .set_path("data.eval_file", &eval)
        .set("train.max_steps", 6)
        .set("train.batch_size", 8)
        .set("eval.strategy", "steps")
        .set("eval.steps", 3)
        .set(
            "train.report_to",
            toml::Value::Array(vec!["tensorboard".into()]),
        )
        .write(&tmp.path().join("tb.toml"));
    ok(sprtrain().arg("--config").arg(&config).output().unwrap());
    let runs = out.join("runs");
    let files: Vec<_> = std::fs::read_dir(&runs).unwrap().flatten().collect();
    assert_eq!(files.len(), 1);
    assert!(files[0]
        .file_name()
        .to_string_lossy()
        .starts_with("events.out.tfevents."));

    let read = std::process::Command::new(python)
        .args(["-c", READER])
        .arg(&runs)
        .output()
        .unwrap();
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let scalars: Value = serde_json::from_slice(&read.stdout).unwrap();
    let logged: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &Value| r.get("event").is_none())
        .collect();
    let mut checked = 0;
    for record in &logged {
        let step = record["step"].as_u64().unwrap();
        for (key, value) in record.as_object().unwrap() {
            let (Some(value), false) = (value.as_f64(), key == "step") else {
                continue;
            };
            let tag = match key.strip_prefix("eval_") {
                Some(rest) => format!("eval/{rest}"),
                None => format!("train/{key}"),
            };
            let points = scalars[&tag]
                .as_array()
                .unwrap_or_else(|| panic!("no {tag} in {scalars}"));
            let point = points
                .iter()
                .find(|p| p[0].as_u64() == Some(step))
                .unwrap_or_else(|| panic!("no {tag} at step {step}: {points:?}"));
            assert_eq!(
                point[1].as_f64().unwrap() as f32,
                value as f32,
                "{tag} at {step}"
            );
            checked += 1;
        }
    }
    assert_eq!(scalars["train/loss"].as_array().unwrap().len(), 6);
    assert_eq!(scalars["eval/f1"].as_array().unwrap().len(), 2);
    assert!(checked > 50, "only {checked} values checked");
}
