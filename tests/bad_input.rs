//! Bad input gets one clear error line naming the path and a non-zero exit, never a panic.

mod common;

use std::path::{Path, PathBuf};

use common::{fixtures, sprtrain};

/// A writable copy of a fixture model.
fn model_copy(case: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(fixtures().join("parity").join(case)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    (tmp, dir)
}

/// Runs predict and returns its single stderr line, asserting failure without a panic.
fn predict_error(model: &Path, input: Option<&Path>) -> String {
    let out = tempfile::tempdir().unwrap();
    let default_input = fixtures()
        .join("parity")
        .join("distilbert-seq-cls-single")
        .join("predict_input.jsonl");
    let run = sprtrain()
        .args(["predict", "--task", "seq-cls", "--model"])
        .arg(model)
        .arg("--input")
        .arg(input.unwrap_or(&default_input))
        .arg("--output")
        .arg(out.path().join("o.jsonl"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr).trim().to_string();
    assert_eq!(
        run.status.code(),
        Some(1),
        "expected exit 1, stderr: {stderr}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("internal error"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "expected one line: {stderr}");
    assert!(stderr.starts_with("sprtrain: error: "), "{stderr}");
    assert!(
        !out.path().join("o.jsonl").exists(),
        "no output may be written on error"
    );
    eprintln!("{stderr}");
    stderr
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

#[test]
fn missing_model_directory() {
    let e = predict_error(Path::new("/nonexistent/model"), None);
    assert!(
        e.contains("model directory /nonexistent/model does not exist"),
        "{e}"
    );
}

#[test]
fn directory_without_config() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let e = predict_error(&dir, None);
    assert!(
        e.contains(&format!(
            "no config.json in model directory {}",
            dir.display()
        )),
        "{e}"
    );
}

#[test]
fn malformed_config_json() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"distilbert\", ").unwrap();
    let e = predict_error(&dir, None);
    assert!(
        e.contains(&format!(
            "invalid model config {}",
            dir.join("config.json").display()
        )),
        "{e}"
    );
    assert!(e.contains("malformed JSON"), "{e}");
}

#[test]
fn unsupported_model_type() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    edit_config(&dir, |v| v["model_type"] = "t5".into());
    let e = predict_error(&dir, None);
    assert!(
        e.contains("config.json") && e.contains("unsupported model_type \"t5\""),
        "{e}"
    );
}

/// Runs a command expected to fail and returns its last stderr line (training logs first).
fn failure_line(cmd: &mut std::process::Command) -> String {
    let run = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr).trim().to_string();
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default().to_string();
    assert!(last.starts_with("sprtrain: error: "), "{stderr}");
    eprintln!("{last}");
    last
}

/// Decoders: a causal-LM task on an encoder, generation from an encoder, a prompt longer than
/// GPT-2's positions, and a chat template that refuses the conversation each end in one line.
#[test]
fn decoder_misuse_is_one_clear_line() {
    let bert = fixtures().join("parity").join("bert-qa");
    let e = check_error(
        &format!(
            "[model]\nname_or_path = \"{}\"\ntask = \"causal-lm\"\n",
            bert.display()
        ),
        &[],
    );
    assert!(e.contains("is an encoder: it has no causal-LM head"), "{e}");

    let e = failure_line(
        sprtrain()
            .args(["generate", "--prompt", "hi", "--model"])
            .arg(&bert),
    );
    assert!(e.contains("cannot load a causal language model"), "{e}");

    let gpt2 = fixtures().join("parity").join("gpt2-causal-lm");
    let long = "Paris is the capital ".repeat(40);
    let e = failure_line(
        sprtrain()
            .args(["generate", "--prompt", &long, "--model"])
            .arg(&gpt2),
    );
    assert!(e.contains("positions leave no room to generate"), "{e}");

    let (tmp, dir) = model_copy("llama-causal-lm");
    let template = "{% for m in messages %}{% if loop.first and m['role'] != 'user' %}{{ raise_exception('the first turn must be the user') }}{% endif %}{{ m['content'] }}{% endfor %}";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template}).to_string(),
    )
    .unwrap();
    let data = tmp.path().join("chat.jsonl");
    let conversation = serde_json::json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Hello."}
    ]});
    std::fs::write(&data, format!("{conversation}\n")).unwrap();
    let config = common::RunConfig::new(&dir, &data, &tmp.path().join("out"))
        .set("model.task", "causal-lm")
        .set("train.max_steps", 1)
        .write(&tmp.path().join("chat.toml"));
    let e = failure_line(sprtrain().arg("--config").arg(&config));
    assert!(
        e.contains("fails to render") && e.contains("the first turn must be the user"),
        "{e}"
    );
}

#[test]
fn missing_weights() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = predict_error(&dir, None);
    assert!(
        e.contains("no model.safetensors or model.safetensors.index.json in"),
        "{e}"
    );
}

#[test]
fn truncated_safetensors() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = predict_error(&dir, None);
    assert!(
        e.contains(&format!(
            "{} is not a valid safetensors file",
            path.display()
        )),
        "{e}"
    );
}

#[test]
fn corrupt_safetensors_header() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..20].copy_from_slice(b"not json at ");
    std::fs::write(&path, &bytes).unwrap();
    let e = predict_error(&dir, None);
    assert!(e.contains("is not a valid safetensors file"), "{e}");
}

#[test]
fn missing_shard() {
    let (_t, dir) = model_copy("bert-seq-cls-single");
    std::fs::remove_file(dir.join("model-00002-of-00003.safetensors")).unwrap();
    let e = predict_error(&dir, None);
    assert!(
        e.contains("model-00002-of-00003.safetensors named by") && e.contains("is missing"),
        "{e}"
    );
}

#[test]
fn tensor_of_the_wrong_shape() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    edit_config(&dir, |v| v["hidden_dim"] = 64.into());
    let e = predict_error(&dir, None);
    assert!(
        e.contains("tensor distilbert.transformer.layer.0.ffn.lin1.bias has shape [48]"),
        "{e}"
    );
    assert!(
        e.contains("DistilBertForSequenceClassification expects [64]"),
        "{e}"
    );
}

fn rewrite_tensor(
    dir: &Path,
    name: &str,
    dtype: safetensors::Dtype,
    data: Vec<u8>,
    shape: Vec<usize>,
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = Vec::new();
    for (n, v) in st.tensors() {
        if n == name {
            continue;
        }
        views.push((n, v));
    }
    views.push((
        name.to_string(),
        safetensors::tensor::TensorView::new(dtype, shape, &data).unwrap(),
    ));
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(path, out).unwrap();
}

#[test]
fn tensor_of_the_wrong_dtype() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    rewrite_tensor(
        &dir,
        "classifier.bias",
        safetensors::Dtype::I64,
        vec![0u8; 3 * 8],
        vec![3],
    );
    let e = predict_error(&dir, None);
    assert!(
        e.contains("tensor classifier.bias has dtype Int64, expected a floating-point type"),
        "{e}"
    );
}

#[test]
fn missing_backbone_tensor() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    // Renaming a backbone tensor leaves the real one missing (and the renamed one unused).
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n.replace("layer.1.ffn.lin2.weight", "layer.1.ffn.lin2.wieght"),
                v,
            )
        })
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(&path, out).unwrap();
    let e = predict_error(&dir, None);
    assert!(
        e.contains(
            "tensor distilbert.transformer.layer.1.ffn.lin2.weight is missing from the checkpoint"
        ),
        "{e}"
    );
}

#[test]
fn missing_tokenizer_json() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let e = predict_error(&dir, None);
    assert!(
        e.contains(&format!(
            "tokenizer file {} does not exist",
            dir.join("tokenizer.json").display()
        )),
        "{e}"
    );
}

#[test]
fn malformed_tokenizer_json() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    std::fs::write(dir.join("tokenizer.json"), "{\"version\": ").unwrap();
    let e = predict_error(&dir, None);
    assert!(e.contains("is not a valid tokenizer.json"), "{e}");
}

/// A WordPiece vocabulary without its unk_token (found by the fuzz harness): refused when the
/// tokenizer loads, naming the file, not when the first unknown word is met.
#[test]
fn tokenizer_without_its_unknown_token() {
    let (_t, dir) = model_copy("distilbert-seq-cls-single");
    let path = dir.join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    assert!(vocab.remove("[UNK]").is_some());
    std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
    let e = predict_error(&dir, None);
    assert!(
        e.contains(&format!(
            "{} is not a valid tokenizer.json: the WordPiece model's unk_token \"[UNK]\" is not in its vocab",
            path.display()
        )),
        "{e}"
    );
}

#[test]
fn bad_input_lines_name_file_and_line() {
    let dir = fixtures().join("parity").join("distilbert-seq-cls-single");
    let input = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(input.path(), "{\"text\": \"fine\"}\n\n{\"text\": 3}\n").unwrap();
    let e = predict_error(&dir, Some(input.path()));
    assert!(
        e.contains(&format!(
            "{}:3: field \"text\" must be a string",
            input.path().display()
        )),
        "{e}"
    );
    std::fs::write(input.path(), "{\"text\": \"fine\"}\n{\"txt\": \"x\"}\n").unwrap();
    let e = predict_error(&dir, Some(input.path()));
    assert!(e.contains(":2: missing field \"text\""), "{e}");
    std::fs::write(input.path(), "{\"text\": \"fine\"\n").unwrap();
    let e = predict_error(&dir, Some(input.path()));
    assert!(e.contains(":1: invalid JSON"), "{e}");
}

/// `sprtrain check --config`: config errors name the file and the dotted key.
fn check_error(config_text: &str, sets: &[&str]) -> String {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), config_text).unwrap();
    let mut cmd = sprtrain();
    cmd.args(["check", "--config"]).arg(file.path());
    for s in sets {
        cmd.args(["--set", s]);
    }
    let run = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr).trim().to_string();
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&file.path().display().to_string()),
        "{stderr}"
    );
    eprintln!("{stderr}");
    stderr
}

#[test]
fn config_errors_name_file_and_key() {
    let model = fixtures().join("parity").join("bert-qa");
    let base = format!(
        "[model]\nname_or_path = \"{}\"\ntask = \"qa\"\n",
        model.display()
    );
    assert!(check_error(&format!("{base}max_seq_lenn = 64\n"), &[])
        .contains("model.max_seq_lenn: unknown field"));
    assert!(check_error(&base, &["runtime.threads=two"]).contains("runtime.threads: invalid type"));
    assert!(check_error(&base, &["model.max_seq_len=4096"]).contains("exceeds the 64 tokens"));
    assert!(check_error(&base, &["model.task=ner"]).contains("model.task: unknown variant `ner`"));
}

#[test]
fn check_loads_and_prints_the_resolved_config() {
    let model = fixtures().join("parity").join("bert-qa");
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        format!(
            "[model]\nname_or_path = \"{}\"\ntask = \"qa\"\n",
            model.display()
        ),
    )
    .unwrap();
    let run = sprtrain()
        .args(["check", "--set", "model.max_seq_len=32", "--config"])
        .arg(file.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("BertForQuestionAnswering") && stdout.contains("max_seq_len = 32"),
        "{stdout}"
    );
    assert!(
        run.stderr.is_empty(),
        "a matching checkpoint loads silently"
    );

    // A classification checkpoint fine-tuned for QA: one line for the unused pooler and
    // classifier, one for the new qa_outputs, as transformers reports them.
    let model = fixtures().join("parity").join("bert-seq-cls-single");
    std::fs::write(
        file.path(),
        format!(
            "[model]\nname_or_path = \"{}\"\ntask = \"qa\"\nmax_seq_len = 64\n",
            model.display()
        ),
    )
    .unwrap();
    let run = sprtrain()
        .args(["check", "--config"])
        .arg(file.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(lines[0].contains("were not used when initializing BertForQuestionAnswering: [bert.pooler.dense.bias, bert.pooler.dense.weight, classifier.bias, classifier.weight]"), "{stderr}");
    assert!(
        lines[1].contains("newly initialized: [qa_outputs.bias, qa_outputs.weight]"),
        "{stderr}"
    );
}
