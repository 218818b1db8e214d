//! Question answering under `mpirun -n 2`, in its own test binary so that its job never runs
//! beside the fault tests of tests/mpi.rs (a loaded machine delayed their kill -9 check).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{fixtures, losses, max_rel_diff, require_mpirun, run_ok, RunConfig};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_sprtrain");

/// Question answering under two ranks: training steps equal one rank's with the double batch
/// (fp32, 1e-5 relative), and `sprtrain eval` sharded over two ranks, start/end logits gathered,
/// gives the same EM/F1 and the same predictions.json as one rank.
#[test]
fn question_answering_trains_and_evaluates_sharded() {
    let Some(mpirun) = require_mpirun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("squad.json");
    common::write_squad(&data, 20);
    // The tiny QA BERT with dropout off, and every batch padded to 32 tokens (the span loss is a
    // softmax over all positions, padding included, as in transformers), so one micro-batch of
    // 2B and two of B compute the same mean.
    let model = tmp.path().join("bert-qa");
    std::fs::create_dir(&model).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixtures().join("parity/bert-qa").join(f), model.join(f)).unwrap();
    }
    let config = std::fs::read_to_string(fixtures().join("parity/bert-qa/config.json")).unwrap();
    let mut config: Value = serde_json::from_str(&config).unwrap();
    config["hidden_dropout_prob"] = 0.0.into();
    config["attention_probs_dropout_prob"] = 0.0.into();
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let cfg = |name: &str, batch: usize| -> (PathBuf, PathBuf) {
        let out = tmp.path().join(name);
        let path = RunConfig::new(&model, &data, &out)
            .set("model.task", "qa")
            .set("data.eval_split", 0.25)
            .set("data.pad_to_max_length", true)
            .set("qa.doc_stride", 8)
            .set("train.max_steps", 6)
            .set("train.batch_size", batch as i64)
            .set("train.learning_rate", 3e-3)
            .set("eval.batch_size", 5)
            .set("runtime.seed", 5)
            .write(&tmp.path().join(format!("{name}.toml")));
        (path, out)
    };
    let (c2, out2) = cfg("qa-two", 4);
    let mut cmd = Command::new(&mpirun);
    cmd.args(["-n", "2", BIN, "--config"]).arg(&c2);
    run_ok(cmd);
    let (c1, out1) = cfg("qa-one", 8);
    let mut cmd = Command::new(BIN);
    cmd.arg("--config").arg(&c1);
    run_ok(cmd);
    let (l1, l2) = (losses(&out1), losses(&out2));
    // 53 windows: 6 full global batches of 8 (a short seventh would average its micro-batches).
    assert_eq!(l1.len(), 6);
    let worst = max_rel_diff(&l1, &l2);
    eprintln!("question answering: per-step loss max relative difference {worst:e}");
    assert!(worst <= 1e-5, "{l1:?} vs {l2:?}");

    // The one-rank model evaluated by one and by two ranks.
    let read = |p: PathBuf| -> Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let eval = |ranks: Option<&str>, dir: &str| -> PathBuf {
        let dest = tmp.path().join(dir);
        let mut cmd = match ranks {
            Some(n) => {
                let mut c = Command::new(&mpirun);
                c.args(["-n", n, BIN]);
                c
            }
            None => Command::new(BIN),
        };
        cmd.args(["eval", "--config"])
            .arg(&c1)
            .arg("--output")
            .arg(&dest);
        run_ok(cmd);
        dest
    };
    let (one, two) = (eval(None, "eval-one"), eval(Some("2"), "eval-two"));
    let (m1, m2) = (
        read(one.join("eval_results.json")),
        read(two.join("eval_results.json")),
    );
    assert_eq!(
        m1["eval_exact_match"], m2["eval_exact_match"],
        "{m1} vs {m2}"
    );
    assert_eq!(m1["eval_f1"], m2["eval_f1"], "{m1} vs {m2}");
    let dl = (m1["eval_loss"].as_f64().unwrap() - m2["eval_loss"].as_f64().unwrap()).abs();
    assert!(dl <= 1e-6, "eval loss differs by {dl}");
    let p1 = read(one.join("predictions.json"));
    assert_eq!(p1.as_object().unwrap().len(), 15);
    assert_eq!(p1, read(two.join("predictions.json")));
    eprintln!(
        "question answering: sharded evaluation EM {} F1 {} on one and two ranks",
        m1["eval_exact_match"], m1["eval_f1"]
    );
}
