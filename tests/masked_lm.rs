//! Masked-LM training end to end (run_mlm.py's recipe): masks drawn from the step and the
//! example, so a resumed run masks exactly as an uninterrupted one; the held-out perplexity;
//! line-by-line data; whole-word masking where the tokenizer marks word continuations; and
//! misuse refused with one line. (Parity of 20 steps with transformers and of the masking
//! statistics: tests/train_parity.rs; 2 ranks == 1 rank: tests/mpi.rs.)

mod common;

use std::path::{Path, PathBuf};

use common::{eval_results, fixtures, ok, sprtrain, train_losses, weight_values, RunConfig};

/// 300 short lines over the tiny tokenizer's vocabulary, every fifth blank.
fn write_text(dir: &Path) -> PathBuf {
    let words = [
        "the", "movie", "was", "a", "delight", "paris", "is", "capital", "of", "france",
    ];
    let text: String = (0..300)
        .map(|i| {
            if i % 5 == 4 {
                "\n".to_string()
            } else {
                let n = 3 + i % 6;
                let line: Vec<&str> = (0..n)
                    .map(|j| words[(i * 3 + j * 7) % words.len()])
                    .collect();
                format!("{}\n", line.join(" "))
            }
        })
        .collect();
    let path = dir.join("train.txt");
    std::fs::write(&path, text).unwrap();
    path
}

fn config(dir: &Path, data: &Path, name: &str) -> RunConfig {
    RunConfig::new(&fixtures().join("train_parity_mlm"), data, &dir.join(name))
        .set("model.task", "mlm")
        .set("data.eval_split", 0.1)
        .set("train.max_steps", 8)
        .set("train.batch_size", 4)
        .set("train.learning_rate", 3e-3)
        .set("train.save_steps", 4)
        .set("runtime.seed", 5)
}

#[test]
fn a_resumed_masked_lm_run_masks_and_trains_exactly_as_an_uninterrupted_one() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_text(tmp.path());
    let full = tmp.path().join("full");
    let c = config(tmp.path(), &data, "full").write(&tmp.path().join("full.toml"));
    ok(sprtrain().arg("--config").arg(&c).output().unwrap());
    let r = eval_results(&full);
    let (loss, ppl) = (
        r["eval_loss"].as_f64().unwrap(),
        r["eval_perplexity"].as_f64().unwrap(),
    );
    assert!((ppl - loss.exp()).abs() < 1e-9 * ppl, "{r}");
    assert!(r["eval_tokens"].as_f64().unwrap() > 10.0, "{r}");

    // Resume from checkpoint-4 alone.
    let part = tmp.path().join("part");
    std::fs::create_dir_all(part.join("checkpoint-4")).unwrap();
    for e in std::fs::read_dir(full.join("checkpoint-4"))
        .unwrap()
        .flatten()
    {
        std::fs::copy(e.path(), part.join("checkpoint-4").join(e.file_name())).unwrap();
    }
    let c = config(tmp.path(), &data, "part").write(&tmp.path().join("part.toml"));
    ok(sprtrain()
        .arg("--config")
        .arg(&c)
        .args(["--resume", "latest"])
        .output()
        .unwrap());
    let (a, b) = (train_losses(&full), train_losses(&part));
    assert_eq!(b.iter().map(|x| x.0).collect::<Vec<_>>(), [5, 6, 7, 8]);
    for (step, l) in &b {
        assert_eq!(*l, a[*step as usize - 1].1, "step {step}");
    }
    assert_eq!(weight_values(&full), weight_values(&part));
    assert!(a[0].1 != a[7].1, "the losses must move");
}

#[test]
fn line_by_line_and_whole_word_masking_train() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_text(tmp.path());
    for (name, whole_word) in [("lines", false), ("words", true)] {
        let c = config(tmp.path(), &data, name)
            .set("data.packing", false)
            .set("data.whole_word_mask", whole_word)
            .set("train.save_steps", 0)
            .write(&tmp.path().join(format!("{name}.toml")));
        let log = ok(sprtrain().arg("--config").arg(&c).output().unwrap());
        // 300 lines, 60 of them blank: 240 sequences, 24 held out.
        assert!(
            log.contains("216 examples (24 held for evaluation)"),
            "{log}"
        );
        assert!(
            eval_results(&tmp.path().join(name))["eval_perplexity"]
                .as_f64()
                .unwrap()
                > 1.0
        );
    }
}

#[test]
fn masked_lm_misuse_is_refused_with_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_text(tmp.path());
    let cases: Vec<(RunConfig, &str)> = vec![
        (
            config(tmp.path(), &data, "decoder").set_path(
                "model.name_or_path",
                &fixtures().join("parity").join("llama-causal-lm"),
            ),
            "model.task \"mlm\" needs an encoder (bert, distilbert, roberta, xlm-roberta, electra, deberta-v2, modernbert); the model is Llama",
        ),
        (
            config(tmp.path(), &data, "bpe")
                .set_path(
                    "model.name_or_path",
                    &fixtures().join("parity").join("roberta-mlm"),
                )
                .set("data.whole_word_mask", true),
            "data.whole_word_mask needs a WordPiece tokenizer",
        ),
        (
            config(tmp.path(), &data, "rate").set("data.mlm_probability", 1.5),
            "data.mlm_probability must be in (0, 1), got 1.5",
        ),
        (
            config(
                tmp.path(),
                &fixtures().join("data").join("chat.jsonl"),
                "chat",
            ),
            "masked-LM training reads plain text (lines, or a text field), not prompts or messages",
        ),
    ];
    for (i, (c, want)) in cases.into_iter().enumerate() {
        let path = c.write(&tmp.path().join(format!("bad{i}.toml")));
        let out = sprtrain().arg("--config").arg(&path).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "case {i} ran");
        assert!(stderr.contains(want), "case {i}: {stderr}");
    }
}
